"""The hostile campaign's failing disks and shared-server rules (issue 59).

The world's state folder and dataset folder lie on small real file systems of their own
(tests/conftest.py's tmpfs). Actions turn one read-only for a while, or fill the state disk to
ENOSPC, then give it back; meanwhile `eagle3ctl status` is polled every second. After every
action: nothing the daemon made is open to other users (docs/operations.md, "Shared servers":
UMask 0027, folders 0750 or 0700), and no process of the daemon's listens beyond loopback.
A walk that faulted a disk ends with the operator's `--until done`, which must train every
sample once.

A read-only disk is a read-only bind mount of the tmpfs over itself, undone by unmounting that
bind: `mount -o remount,ro` of the tmpfs itself is refused (EBUSY) while the daemon holds a file
on it open for writing, and it always holds `daemon.lock` and the ledger. The bind is a mount of
the walk's own, and every open after it meets EROFS, as after the kernel's errors=remount-ro.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Callable


from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger
from tests.chaos import operator_walk as ow
from tests.chaos.operator_walk import Violation, World
from tests.pipeline import edit_config, fill_file_system, listeners_beyond_loopback

STATE_DISK = "160m"     # the state reserve (32 MiB) is taken back once twice that is free
DATASET_DISK = "256m"   # LIFT (100 MiB) must stay free on it
BALLAST = 4 * 2**20     # World.hold: the reserve that pauses lies within what is used
RUNNING = (0, 4, 5, 9)  # status's exit codes of a live daemon that a disk fault may show


def disks(world: World, mount: Callable[[str, str], Path]) -> None:
    """The state and dataset folders moved to disks of their own, before the first start."""
    for name, size, key in (("state", STATE_DISK, "state_dir"),
                            ("dataset", DATASET_DISK, "dataset_dir")):
        disk = mount(f"{name}-disk", size)
        world.moved[name] = disk / name
        edit_config(world.config, "paths", **{key: str(disk / name)})
    (world.moved["dataset"].parent / "ballast").write_bytes(b"\0" * BALLAST)
    edit_config(world.config, "budget", reserve=world.hold())


def _disk(world: World, name: str) -> Path | None:
    """The mount point of the world's `name` disk, while the config still keeps that folder
    there (an edit may have moved it elsewhere)."""
    moved = world.moved.get(name)
    key = "state_dir" if name == "state" else "dataset_dir"
    if moved is None or not str(world.folder(key)).startswith(str(moved)):
        return None
    return moved.parent


def _counts(world: World) -> dict[str, tuple[str, int]]:
    run = ow._current(world)
    if run is None or not layout.ledger(run.state_dir).exists():
        return {}
    with Ledger(layout.ledger(run.state_dir), readonly=True, timeout=30) as ledger:
        return {s.id: (s.status, s.attempts) for s in ledger.samples()}


class fault:
    """A disk fault that lasts `seconds`: status polled every second meanwhile (the daemon
    lives, answers in one of RUNNING with no traceback), and no sample failed by it."""

    def __init__(self, world: World, what: str, seconds: float) -> None:
        self.world, self.what, self.seconds = world, what, seconds

    def __enter__(self) -> "fault":
        self.before = _counts(self.world)
        self.seen: set[int] = set()
        return self

    def hold(self) -> None:
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            answered(self.world, f"while {self.what}", self.seen)
            time.sleep(1.0)

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        self.world.faults += 1
        time.sleep(3.0)  # a tick or two with the disk back
        answered(self.world, f"after {self.what} ended", self.seen)
        after = _counts(self.world)
        failed = sorted(s for s, (st, _) in after.items()
                        if st == "failed" and self.before.get(s, ("",))[0] != "failed")
        if failed:
            raise Violation("no attempt is charged for a disk fault",
                            f"{failed[:4]} failed while {self.what}: "
                            f"{[after[s] for s in failed[:4]]}")


def answered(world: World, during: str, seen: set[int]) -> None:
    """The daemon lives, and `eagle3ctl status` answers with a documented code and no
    traceback."""
    if not world.alive():
        raise Violation("the loop never dies (rule 1)",
                        f"the daemon exited {world.daemon.proc.returncode} {during}: "
                        f"{world.daemon.output()[-800:]}")
    out = ow.ctl(world, "status")
    seen.add(out.returncode)
    if out.returncode not in RUNNING or "Traceback" in out.stdout + out.stderr:
        raise Violation("status answers with the daemon's condition",
                        f"eagle3ctl status exited {out.returncode} {during}: "
                        f"{(out.stdout + out.stderr)[-600:]}")


def read_only(folder: Path) -> "_ReadOnly":
    return _ReadOnly(folder)


class _ReadOnly:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __enter__(self) -> None:
        subprocess.run(["mount", "--bind", str(self.folder), str(self.folder)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(self.folder)], check=True)

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", str(self.folder)], check=True)


def act_disk_read_only(world: World, p: dict[str, Any]) -> str:
    """The state or the dataset disk read-only for a while, then back."""
    disk = _disk(world, p["disk"])
    if not world.alive() or disk is None:
        return "skip"
    with fault(world, f"the {p['disk']} disk was read-only", p["s"]) as f:
        with read_only(disk):
            f.hold()
    return f"{p['disk']} disk read-only {p['s']} s; status said {sorted(f.seen)}"


def act_state_disk_full(world: World, p: dict[str, Any]) -> str:
    """The state disk filled to ENOSPC by another tenant for a while, then freed."""
    disk = _disk(world, "state")
    if not world.alive() or disk is None:
        return "skip"
    with fault(world, "the state disk was full", p["s"]) as f:
        filler = fill_file_system(disk)
        try:
            f.hold()
        finally:
            filler.unlink()
    return f"state disk full {p['s']} s; status said {sorted(f.seen)}"


# ---- the shared-server rules, after every action --------------------------------------------

def private(world: World) -> None:
    """Nothing under the daemon's folders is open to others: no bit for others at all (UMask
    0027: files 0640, folders 0750 or 0700), so none is world-writable either."""
    for key in ("state_dir", "spool_dir", "dataset_dir", "train_dir"):
        top = world.folder(key)
        for path in [top, *_walk(top)]:
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:  # removed meanwhile
                continue
            if mode & 0o007 and not stat.S_ISLNK(mode):
                raise Violation("no file of the daemon's is open to others (shared servers)",
                                f"{path} is {stat.filemode(mode)}")


def _walk(top: Path) -> list[Path]:
    out: list[Path] = []
    for folder, dirs, files in os.walk(top):
        out += [Path(folder) / name for name in dirs + files]
    return out


def loopback_only(world: World) -> None:
    """No process of the daemon's listens on an address another machine can reach."""
    if not world.alive():
        return
    heard = listeners_beyond_loopback(world.daemon.proc.pid)
    if heard:
        raise Violation("no listener beyond loopback (shared servers)",
                        "; ".join(f"{cmd} listens on {ip}:{port}" for cmd, ip, port in heard))


def check(world: World) -> None:
    ow.check(world)
    private(world)
    loopback_only(world)


# ---- the end of a walk that faulted a disk ---------------------------------------------------

def finish(world: World) -> None:
    """With every disk back, the operator's `--until done` reaches done and its drafter was
    trained on every sample the run kept, once; the listeners are checked while it trains."""
    if not world.faults:
        return
    if world.alive():
        code = world.daemon.stop(timeout=200)
        world.daemon = None
        if code != 0:
            raise Violation("a stop is clean", f"the daemon exited {code} on SIGTERM")
    edit_config(world.config, "budget", reserve=ow.LIFT)
    if ow.promise(world)[0] == "start-refused":
        return
    world.daemon = ow.until_done(world)
    deadline = time.monotonic() + 600
    while world.daemon.proc.poll() is None and time.monotonic() < deadline:
        loopback_only(world)
        time.sleep(1.0)
    d, world.daemon = world.daemon, None
    if d.proc.poll() is None:
        d.proc.kill()
        raise Violation("the run reaches done once its disks are back",
                        f"`eagle3d run --until done` still ran after 600 s: {d.output()[-800:]}")
    if d.proc.returncode != 0:
        raise Violation("the run reaches done once its disks are back",
                        f"`eagle3d run --until done` exited {d.proc.returncode}: "
                        f"{d.output()[-800:]}")
    trained_once(world)


def trained_once(world: World) -> None:
    from eagle3d.statemachine import manifest
    run = ow._current(world)
    kept = {s for s, (st, _) in _counts(world).items() if st != "excluded"}
    listed = [s["id"] for s in (manifest.read(run.dataset_dir) or {}).get("samples", [])]
    if sorted(listed) != sorted(kept) or not layout.done_file(run.train_dir).exists():
        raise Violation("every sample is trained once",
                        f"run {run.id}: the drafter's manifest lists {sorted(listed)}, the run "
                        f"keeps {sorted(kept)}; done marker "
                        f"{layout.done_file(run.train_dir).exists()}")


ACTIONS = {"disk-read-only": act_disk_read_only, "state-disk-full": act_state_disk_full}
WEIGHTS = {"disk-read-only": 3, "state-disk-full": 2}


def draw(rng: Any, name: str, p: dict[str, Any]) -> None:
    if name == "disk-read-only":
        p.update(disk=rng.choice(["state", "dataset"]), s=rng.choice([4, 15]))
    elif name == "state-disk-full":
        p["s"] = rng.choice([4, 15])
