"""The randomized operator's shard campaign (issue 52 items 2, 3 and 8): three shard daemons on
one shared root, `[data] responses = "target"`, over a source with duplicate prompts (two records,
the same user turns, different answers) placed so that ownership matters: the two records of a
pair hash to different shards by their whole conversation, and to one by their sample id.

Shard 0 is the training node; its share is empty by construction (it owns no prompt), so it
plans nothing, is done at once and waits at the gate for the others, which a budget holds after
their plan with no model loaded. Actions start, stop and kill -9 any shard, and kill one "on
another host": killed -9, its temp files in the train folder named for another host, its
published heartbeat three days old.

Invariants, after every step, besides the operator campaign's on the training node: a sample id
appears once in the union of the shards' ledgers and of their published manifests; the training
node's status exits 8 while another shard is stale, stopped before done or held, and not 8 while
none has started; another host's temp files are never removed; no shard daemon exits unbidden.
"""

from __future__ import annotations

import json
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3d.capture.planner import prompt_turns, sample_id
from eagle3d.dataset import shard_union
from eagle3d.statemachine import layout, manifest, shards
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.ledger import Ledger
from tests.chaos import operator_walk as ow
from tests.chaos.harness import kill9
from tests.chaos.operator_walk import Notify, Violation, World
from tests.conftest import make_config
from tests.pipeline import DaemonProcess

COUNT = 3
FAR_HOST = "node-b_example"  # another host's name, as atomic.HOST writes it
FAR_AGE_S = 3 * 86400.0


@dataclass
class ShardWorld(World):
    configs: list[Path] = field(default_factory=list)
    lives: list[DaemonProcess | None] = field(default_factory=list)
    notifies: list[Notify] = field(default_factory=list)
    started: set[int] = field(default_factory=set)   # shards that ever ran
    far: set[int] = field(default_factory=set)       # killed "on another host", not restarted
    halted: set[int] = field(default_factory=set)    # stopped by SIGTERM before done
    planted: list[Path] = field(default_factory=list)  # another host's temp files


def _owner(messages: list[dict], by_prompt: bool) -> int:
    return shards.owner(sample_id(prompt_turns(messages) if by_prompt else messages), COUNT)


def duplicate_source(path: Path, pairs: int) -> Path:
    """Prompts none of which shard 0 owns, each twice with different answers, the two records of
    each pair owned by different shards by their whole conversation."""
    records, i = [], 0
    while len(records) < 2 * pairs:
        i += 1
        q = {"role": "user", "content": f"Question {i}: " + " ".join(f"w{i * k % 97}"
                                                                   for k in range(10))}
        a, b = ([q, {"role": "assistant", "content": f"Answer {i}{tag}: r{i % 89}"}]
                for tag in ("", " again"))
        if _owner(a, True) != 0 and _owner(a, False) != _owner(b, False):
            records += [a, b]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    return path


def new_world(tmp: Path, rng: random.Random, scale: int) -> ShardWorld:
    source = duplicate_source(tmp / "conv.jsonl", 2 * scale)
    spool = Path("/dev/shm") / f"eagle3d-test-{tmp.name}-{random.Random().getrandbits(32):x}"
    configs = [make_config(tmp, {
        "data": {"source": str(source), "format": "messages", "limit": 4 * scale,
                 "shards": COUNT, "shard": k, "responses": "target"},
        "paths": {"spool_dir": str(spool)}, "verify": {"spot_checks": 0},
        "budget": {"reserve": ow.LIFT if k == 0 else ow.HOLD}}, name=f"shard{k}.toml")
        for k in range(COUNT)]
    notifies = [Notify(Path("/tmp") / f"eagle3d-notify-{rng.getrandbits(40):x}")
                for _ in range(COUNT)]
    return ShardWorld(tmp, configs[0], notifies[0], 4 * scale, configs=configs,
                      lives=[None] * COUNT, notifies=notifies)


def _alive(world: ShardWorld, k: int) -> bool:
    d = world.lives[k]
    return d is not None and d.proc.poll() is None


def _set_life(world: ShardWorld, k: int, d: DaemonProcess | None) -> None:
    world.lives[k] = d
    if k == 0:
        world.daemon = d


def act_start(world: ShardWorld, p: dict[str, Any]) -> str:
    k = p["shard"]
    if _alive(world, k):
        return "skip"
    d = DaemonProcess(world.configs[k], env=world.notifies[k].env())
    _set_life(world, k, d)
    world.started.add(k)
    world.far.discard(k)
    world.halted.discard(k)
    ok = ow.wait(lambda: d.proc.poll() is not None or world.notifies[k].after(0, "READY=1"), 60)
    if d.proc.poll() is not None or not ok:
        raise Violation("a shard starts", f"shard {k} exited {d.proc.returncode} at its start: "
                        f"{d.output()[-600:]}")
    if k == 0:
        world.watched_from = world.notify.after(0, "READY=1") or 0.0
    ow.wait(lambda: _published(world, k), ow.SETTLE_S)
    return f"shard {k} started"


def _published(world: ShardWorld, k: int) -> bool:
    st = _published_state(world, k)
    return st.get("daemon", {}).get("pid") == world.lives[k].proc.pid and \
        st.get("stage") not in (None, "not started", "plan")


def _folder(world: ShardWorld, k: int) -> Path:
    root = Path(tomllib.loads(world.configs[k].read_text())["paths"]["dataset_dir"])
    return shards.all_folders(root, COUNT)[k][1]


def _published_state(world: ShardWorld, k: int) -> dict[str, Any]:
    try:
        return tomllib.loads(layout.published_state(_folder(world, k)).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def act_stop(world: ShardWorld, p: dict[str, Any]) -> str:
    k = p["shard"]
    if not _alive(world, k):
        return "skip"
    code = world.lives[k].stop(timeout=200)
    _set_life(world, k, None)
    if code != 0:
        raise Violation("a stop is clean", f"shard {k} exited {code} on SIGTERM")
    world.halted.add(k)
    return f"shard {k} stopped"


def act_kill(world: ShardWorld, p: dict[str, Any]) -> str:
    k = p["shard"]
    if not _alive(world, k):
        return "skip"
    kill9(world.lives[k])
    _set_life(world, k, None)
    world.crashes += 1
    return f"shard {k} killed -9"


def act_far_kill(world: ShardWorld, p: dict[str, Any]) -> str:
    """A shard's host lost: its daemon killed -9 with its temp files in the shared train folder
    named for that host, and its last published heartbeat three days old."""
    k = 1 + p["shard"] % (COUNT - 1)
    if not _alive(world, k):
        return "skip"
    pid = world.lives[k].proc.pid
    kill9(world.lives[k])
    _set_life(world, k, None)
    world.crashes += 1
    train = Path(tomllib.loads(world.configs[k].read_text())["paths"]["train_dir"])
    train.mkdir(parents=True, exist_ok=True)
    for name in ("progress.json", "done.json"):
        temp = train / f".{name}.{FAR_HOST}.{pid}.tmp"
        temp.write_text("half")
        world.planted.append(temp)
    path = layout.published_state(_folder(world, k))
    if path.exists():
        text = path.read_text()
        st = tomllib.loads(text)
        beat = st.get("daemon", {}).get("heartbeat")
        if beat is not None:
            atomic_write_bytes(path, text.replace(repr(beat), repr(beat - FAR_AGE_S)).encode())
    world.far.add(k)
    return f"shard {k} lost with its host (temps for {FAR_HOST}, heartbeat 3 days old)"


def check(world: ShardWorld) -> None:
    for k in range(COUNT):
        d = world.lives[k]
        if d is not None and d.proc.poll() is not None:
            raise Violation("the loop never dies (rule 1)",
                            f"shard {k} exited {d.proc.returncode} unbidden: {d.output()[-600:]}")
    ow.check(world)
    ids_once(world)
    gone = [str(t) for t in world.planted if not t.exists()]
    if gone:
        raise Violation("only the training node touches train_dir, and only its host's temps",
                        f"another host's temp files were removed: {gone}")
    if _alive(world, 0):
        training_node_status(world)


def ids_once(world: ShardWorld) -> None:
    """A sample id appears once in the union: of the shards' ledgers, of their manifests."""
    where: dict[str, int] = {}
    for k in range(COUNT):
        for path in world.root.glob(f"state/**/{shards.folder_name(k, COUNT)}/**/"
                                    f"{layout.ledger(Path('.')).name}"):
            with Ledger(path, readonly=True, timeout=10) as ledger:
                for s in ledger.samples():
                    if where.setdefault(s.id, k) != k:
                        raise Violation("a sample id appears once in the union",
                                        f"{s.id} is planned by shard {where[s.id]} and shard {k}")
    parts = [(name, manifest.read(folder)) for name, folder in
             shards.all_folders(_folder(world, 0).parent, COUNT)
             if layout.manifest_file(folder).is_file()]
    twice = shard_union.duplicates([(n, doc) for n, doc in parts if doc])
    if twice:
        raise Violation("a sample id appears once in the union", "; ".join(twice))


def training_node_status(world: ShardWorld) -> None:
    """Exit 8 while another shard is in trouble (stale or stopped before it was done, held by
    its budget), and while no other shard has started, 8 only for shards never heard from (a
    minute after the training node's daemon started). A shard that had published its share
    as done needs no one when its host is lost: its share is in the shared folder."""
    code, st = ow.status(world)
    own = st.get("stage") == "failed" or st.get("config_problem") or \
        st.get("paused_by") == "budget" or st.get("gate", {}).get("waits_for_operator")
    others = range(1, COUNT)
    published = {k: _published_state(world, k) for k in others}
    trouble = [k for k in others if (k in world.far or k in world.halted) and
               published[k].get("underlying") != "done" or
               _alive(world, k) and published[k].get("paused_by") == "budget"]
    if trouble and not own and code != 8:
        raise Violation("the training node's status names every shard in trouble",
                        f"shards {trouble} are stale, stopped or held; status exits {code}: "
                        f"{st.get('shards_down') or st.get('reason')}")
    if not any(k in world.started for k in others) and code == 8 and not all(
            "never heard from" in down for down in st.get("shards_down", [])):
        raise Violation("the training node's status names every shard in trouble",
                        f"no other shard has started; status exits 8: {st.get('shards_down')}")


def close(world: ShardWorld) -> None:
    for k in range(1, COUNT):
        if _alive(world, k):
            world.lives[k].stop(timeout=200)
    for n in world.notifies[1:]:
        n.close()
        n.path.unlink(missing_ok=True)


def draw(rng: random.Random, name: str, p: dict[str, Any]) -> None:
    ow.draw(rng, name, p)
    p["shard"] = rng.randrange(COUNT)


ACTIONS = {"start": act_start, "stop": act_stop, "kill": act_kill, "far-kill": act_far_kill,
           "wait": ow.act_wait}
WEIGHTS = {"start": 6, "stop": 2, "kill": 2, "far-kill": 2, "wait": 1}


def act_start_any(world: ShardWorld, p: dict[str, Any]) -> str:
    """A drawn start starts its shard; the walk's first (no shard drawn) starts every shard, the
    training node first."""
    if "shard" in p:
        return act_start(world, p)
    return "; ".join(act_start(world, {"shard": k}) for k in range(COUNT))


SHARDS = ow.Campaign("shards", new_world, {**ACTIONS, "start": act_start_any}, WEIGHTS, draw,
                     check, close)
