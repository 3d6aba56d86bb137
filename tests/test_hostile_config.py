"""A hostile config: every number bounded and finite, every failure a ConfigError naming the
file and the key, and a reload of any file whatever refused by a daemon that keeps running with
the config it had."""

from __future__ import annotations

import math
import os
import random
import signal
import struct
from pathlib import Path
from typing import Any, Iterator

import pytest
import tomli_w
import tomllib

from eagle3d.capture import engines
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import (INT64_MAX, BudgetConfig, Config, DataConfig,
                                                section_classes)
from eagle3d.statemachine.config_validation import MAX_CONFIG_BYTES, ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import write_conversations
from tests.pipeline import DaemonProcess, status, wait_for

# Every number an operator writes: the sections' int and float fields (the schema's and the
# engines'), and the sizes.
ENGINE_SECTIONS = {name: s.cls for name, s in engines.sections().items()}
SECTIONS = {"data": DataConfig, **{s: type(d) for s, d in Config._field_defaults.items()
                                   if s in section_classes()}, **ENGINE_SECTIONS}
NUMERIC = [(section, key) for section, cls in SECTIONS.items()
           for key, default in cls._field_defaults.items() if type(default) in (int, float)]
SIZES = [("budget", key) for key in BudgetConfig._fields]

HOSTILE = [math.nan, math.inf, -math.inf, 1e308, -1e308, 2**63, 2**64, -2**63 - 1, 10**400,
           -(10**400), True, "12", "nan", [1], {"a": 1}, -1, 0, 1.5, "9" * 40 + "GiB",
           "1e999 GiB", "99999999999999999999 TiB"]


def numbers(value: Any) -> Iterator[Any]:
    """Every int and float inside a parsed config."""
    if isinstance(value, tuple):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def random_value(rng: random.Random) -> Any:
    """A hostile number: one of HOSTILE, an int of up to 300 bits, or any 64-bit pattern as a
    float (nan, inf and subnormals among them)."""
    pick = rng.randrange(3)
    if pick == 0:
        return rng.choice(HOSTILE)
    if pick == 1:
        return rng.choice((1, -1)) * rng.getrandbits(rng.randrange(1, 300))
    return struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]


def test_every_numeric_key_is_bounded_and_finite_or_refused_naming_the_key(config_factory):
    """A seeded campaign over every numeric key: a hostile value is a ConfigError naming the
    file and the key, or a value that fits an SQLite integer (a float a finite one). Before,
    nan and inf passed every minimum, 2**64 reached the ledger, and "9"*40 GiB was an
    OverflowError out of load_config."""
    path = config_factory()
    written = tomllib.loads(path.read_text())
    rng = random.Random(59)
    keys = NUMERIC + SIZES
    assert ("data", "limit") in keys and ("extract", "inflight_timeout_s") in keys
    cases = [(key, value) for key in keys for value in HOSTILE]
    cases += [(rng.choice(keys), random_value(rng)) for _ in range(400)]
    for (section, key), value in cases:
        doc = {s: dict(v) for s, v in written.items()}
        doc.setdefault(section, {})[key] = value
        path.write_text(tomli_w.dumps(doc))
        try:
            cfg = engines.checked(load_config(path))  # as the daemon and eagle3ctl load it
        except ConfigError as exc:
            assert str(exc).startswith(f"{path}: ["), (section, key, value, exc)
            continue
        read = [*cfg[1:-1], *(s.of(cfg) for s in engines.sections().values())]
        got = getattr(engines.sections()[section].of(cfg) if section in ENGINE_SECTIONS else
                      getattr(cfg, section), key)
        for n in numbers(tuple(read)):
            fits = math.isfinite(n) if isinstance(n, float) else abs(n) <= INT64_MAX
            assert fits, (section, key, value, got)
        if isinstance(value, float) and not math.isfinite(value):
            pytest.fail(f"[{section}] {key} = {value!r} was taken as {got!r}")


@pytest.mark.parametrize("key,value", [("data.limit", 2**63), ("extract.inflight_timeout_s", math.nan),
                                       ("train.lr", math.inf), ("budget.reserve", "9" * 40 + "GiB"),
                                       ("generate.seed", 2**64), ("train.epochs", 1e300)])
def test_a_hostile_number_names_its_key(config_factory, key, value):
    section, name = key.split(".")
    path = config_factory({section: {name: value}})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: [{key}] "), caught.value


def hostile_files(folder: Path, good: str) -> dict[str, Path]:
    """Files a config path may come to hold: each must be a ConfigError naming the file."""
    made = {}

    def text(name: str, content: str | bytes) -> None:
        made[name] = folder / f"{name.replace(' ', '-').replace('^', '')}.toml"
        data = content.encode() if isinstance(content, str) else content
        made[name].write_bytes(data)

    text("binary garbage", random.Random(7).randbytes(4096))
    text("integer of 5000 digits", good + "\n[generate]\nseed = " + "9" * 5000 + "\n")
    text("arrays nested 100000 deep", good + "\n[sglang]\nextra_args = " + "[" * 100_000 +
         "]" * 100_000 + "\n")
    text("nan", good + "\n[generate]\ntemperature = nan\n")
    text("an integer past 2^63", good + "\n[train]\nmax_steps = 9223372036854775808\n")
    text("a size past any disk", good + "\n[budget]\nreserve = \"" + "9" * 30 + " TiB\"\n")
    text("wrong types", good.replace("limit = 12", "limit = [12]"))
    text("a source name too long", good.replace("source = ", "source = \"" + "a" * 5000 + "\" #"))
    text("a dotted package", good.replace("source = ", "source = \"pkg:no_such.sub/x\" #"))
    text("a NUL in a string", good + "\n[sglang]\npython = \"py\\u0000thon\"\n")
    text("empty", "")
    text("larger than a config", good + "#" * (MAX_CONFIG_BYTES + 1))
    made["a folder"] = folder / "folder.toml"
    made["a folder"].mkdir()
    made["a symlink loop"] = folder / "loop.toml"
    made["a symlink loop"].symlink_to(folder / "loop.toml")
    made["a FIFO"] = folder / "fifo.toml"
    os.mkfifo(made["a FIFO"])
    made["a device"] = folder / "zero.toml"
    made["a device"].symlink_to("/dev/zero")
    if os.geteuid() != 0:  # root reads any file
        made["an unreadable file"] = folder / "unreadable.toml"
        made["an unreadable file"].write_text(good)
        made["an unreadable file"].chmod(0)
    return made


def messages_source_config(config_factory: Any, tmp_path: Path) -> Path:
    import psutil
    source = write_conversations(tmp_path / "conv.jsonl", 12)
    # A reserve the disk never has free: the daemon plans, then waits on the budget, no engine.
    almost_all = psutil.disk_usage(str(tmp_path)).total - 2**20
    return config_factory({"data": {"source": str(source), "format": "messages", "limit": 12},
                           "budget": {"reserve": almost_all}})


def test_every_hostile_file_is_a_config_error_naming_it(config_factory, tmp_path):
    good = messages_source_config(config_factory, tmp_path).read_text()
    for what, path in hostile_files(tmp_path, good).items():
        with pytest.raises(ConfigError) as caught:
            engines.checked(load_config(path))  # as the daemon and eagle3ctl load it
        assert str(caught.value).startswith(f"{path}: "), (what, caught.value)


def swap_in(config: Path, hostile: Path) -> None:
    """The operator's file is replaced by `hostile` (a rename, as an editor saves)."""
    tmp = config.with_name(config.name + ".new")
    if hostile.is_symlink() or not hostile.is_file() or hostile.stat().st_size > MAX_CONFIG_BYTES:
        os.symlink(os.readlink(hostile) if hostile.is_symlink() else hostile, tmp)
    else:
        tmp.write_bytes(hostile.read_bytes())
    os.replace(tmp, config)


@pytest.mark.slow
def test_a_running_daemon_refuses_a_reload_of_any_file_and_keeps_its_config(config_factory,
                                                                              tmp_path):
    """Each hostile file is reloaded into a real running daemon: the daemon answers, status says
    the reload was refused, and the config in force is byte for byte the one it had."""
    config = messages_source_config(config_factory, tmp_path)
    good = config.read_text()
    (tmp_path / "hostile").mkdir()
    hostile = hostile_files(tmp_path / "hostile", good)
    view = config.with_name("view.toml")  # eagle3ctl's: the file reloaded is hostile
    view.write_text(good)
    state_dir = load_config(config).paths.state_dir
    in_force = layout.config_in_force(state_dir)
    with DaemonProcess(config) as d:
        d.status_until(lambda s: s["stage"] == "paused", 180, "the budget pause")
        before = in_force.read_bytes()
        for n, (what, path) in enumerate(hostile.items(), 1):
            swap_in(config, path)
            d.proc.send_signal(signal.SIGHUP)

            def refused(n: int = n) -> bool:
                assert d.proc.poll() is None, f"the daemon died of {what}:\n{d.output()[-3000:]}"
                with Ledger(layout.ledger(state_dir), readonly=True) as ledger:
                    return len(ledger.events_of(("reload_refused",))) >= n
            wait_for(refused, 60, f"the refusal of {what}")
            st = wait_for(lambda: (s := status(view))["config_problem"] and s, 30, "status")
            assert st["daemon"]["alive"] and "reload refused" in st["config_problem"], (what, st)
            assert in_force.read_bytes() == before, what
        os.replace(view, config)
        assert d.stop() == 0, d.output()[-4000:]
