"""The metrics textfile as node_exporter's textfile collector reads it: parsed with
prometheus_client's own parser, never seen half-written, and a missing folder never fatal."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eagle3d.statemachine.version import VERSION
from tests.pipeline import DaemonProcess, messages_config, status


def scrape(path: Path) -> dict[tuple[str, tuple], float]:
    """Every sample of the file, keyed by name and labels: what a scrape would store."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(path.read_text())
            for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.mark.slow
def test_the_textfile_tells_the_plan_and_is_never_read_half_written(config_factory, tmp_path):
    textfile = tmp_path / "textfile" / "eagle3d.prom"
    textfile.parent.mkdir()
    config = messages_config(config_factory, tmp_path, 6, metrics={"textfile": str(textfile)})
    reads, torn, stop = [0], [], threading.Event()

    def scraper() -> None:  # node_exporter reads whenever it is scraped: here, all the time
        while not stop.is_set():
            try:
                text = textfile.read_text()
            except FileNotFoundError:
                continue
            reads[0] += 1
            if not text.endswith("\n") or "eagle3d_build_info" not in text:
                torn.append(text)
            else:
                list(text_string_to_metric_families(text))  # raises on a broken line

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    with DaemonProcess(config, "--until", "extract") as d:  # the plan only
        assert d.wait(300) == 0, d.output()[-4000:]
    stop.set()
    thread.join()
    assert reads[0] > 10 and not torn
    samples = scrape(textfile)
    run = status(config)["run"]["id"]
    assert value(samples, "eagle3d_build_info", version=VERSION) == 1
    assert value(samples, "eagle3d_samples", status="pending", run=run) == 6
    assert value(samples, "eagle3d_tokens_planned") > 6 * 8
    # The daemon's last word, as it stopped: an alert on eagle3d_up or the heartbeat fires.
    assert value(samples, "eagle3d_stage", stage="stopped") == 1
    assert value(samples, "eagle3d_up") == 0
    assert value(samples, "eagle3d_loop_condition") == 0
    assert value(samples, "eagle3d_disk_free_bytes", role="dataset_dir") > 0
    assert textfile.stat().st_mode & 0o777 == 0o644  # node_exporter runs as its own user


@pytest.mark.slow
def test_a_missing_textfile_folder_is_said_and_the_pipeline_goes_on(config_factory, tmp_path):
    textfile = tmp_path / "no-node-exporter-here" / "eagle3d.prom"
    config = messages_config(config_factory, tmp_path, 2, metrics={"textfile": str(textfile)})
    with DaemonProcess(config, "--until", "extract") as d:
        assert d.wait(300) == 0, d.output()[-4000:]  # the plan went on
        assert d.output().count("metrics: cannot write") == 1  # said once, not every second
    st = status(config)
    assert st["samples"]["total"] == 2 and "cannot write" in (st.get("metrics_problem") or ""), st
    assert not textfile.parent.exists()


def test_only_files_node_exporter_reads_are_accepted(config_factory):
    from eagle3d.statemachine.config_validation import ConfigError, load_config
    config = config_factory({"metrics": {"textfile": "/var/lib/node_exporter/eagle3d.txt"}})
    with pytest.raises(ConfigError, match=r"\[metrics.textfile\].*\.prom"):
        load_config(config)


def test_every_metric_the_alerts_use_is_one_the_daemon_writes():
    """A renamed metric would leave its alert silent forever: an alert over no series never
    fires."""
    import re

    import yaml

    from eagle3d.daemon.metrics import HELP
    rules = yaml.safe_load((Path(__file__).parents[1] / "etc" / "eagle3d-alerts.yml").read_text())
    used = {name for group in rules["groups"] for rule in group["rules"]
            for name in re.findall(r"\beagle3d_[a-z_]+", rule["expr"])}
    assert used and used <= set(HELP), used - set(HELP)


def test_a_loop_condition_is_a_metric_an_alert_pages_on(tmp_path):
    """Status exit 9 (the loop retries a failing tick) reaches monitoring too."""
    from eagle3d.daemon import metrics
    state = {"run": {"id": "r"}, "daemon": {"alive": True, "heartbeat": 1.0},
             "condition": {"reason": "ledger locked", "since": 1.0, "retries": 3}}
    path = tmp_path / "eagle3d.prom"
    metrics.write(path, state)
    assert value(scrape(path), "eagle3d_loop_condition") == 1
    metrics.write(path, {**state, "condition": None})
    assert value(scrape(path), "eagle3d_loop_condition") == 0
