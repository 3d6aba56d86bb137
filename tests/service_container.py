"""A real systemd, booted in a systemd-nspawn container, for tests that drive the service the way
an operator does: `make install`, `systemctl start`, `journalctl`.

The development and CI machines are containers whose PID 1 is not systemd. systemd-nspawn boots
one on a Debian root built once by debootstrap and cached under `.container/` in the checkout
(gitignored). Every boot is `--ephemeral`: it runs on a copy of the cached root, made beside
it and removed at halt, so the next run starts from the same clean machine without rebuilding
it. (`--volatile=overlay` would be cheaper, but its tmpfs is too small for torch.)

Never boot systemd on the host's own root or through `unshare`: its tmpfiles once emptied the
/tmp of every process on the machine. nspawn's `-D` root, under the checkout, keeps it apart.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Sequence

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".container"
ROOT = CACHE / "root"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# systemd and dbus to boot; python3-venv for `make install`; make, sudo and procps for the
# operator's commands (ps, pgrep).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps", "sudo",
            "make", "ca-certificates")
# debootstrap leaves the host's /etc/hostname and no /etc/hosts; any installed machine resolves
# its own name (sudo asks) and localhost (torchrun's rendezvous connects to it).
HOSTNAME = "eagle3d-test"
HOSTS = f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost\n"
# A root is complete once this file holds the recipe it was built from; another recipe rebuilds.
STAMP = ".eagle3d-root"
# The host's pip setup (root's and the system's config, the CA bundle, the local wheel folders
# they name), bound read-only where it exists, so pip as root in the container finds the same
# local wheels (the CPU torch wheel among them) and trusts the same certificates as on the host;
# what they lack comes from the package registry over the host's network.
HOST_PIP = ("/etc/pip.conf", "/etc/xdg/pip", "/root/.config/pip",
            "/etc/ssl/certs/ca-certificates.crt", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")
# Downloads survive the volatile boots here, so the second run installs without the network.
PIP_CACHE = CACHE / "pip-cache"
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def build_root(root: Path = ROOT) -> Path:
    """The cached container root, built by debootstrap (a few minutes) when missing or when
    PACKAGES changed. Built beside under .partial and renamed, so an interrupted build is
    never mistaken for a finished one."""
    recipe = f"{SUITE} {MIRROR} {' '.join(PACKAGES)}\n{HOSTNAME}\n{HOSTS}"
    stamp = root / STAMP
    if stamp.exists() and stamp.read_text() == recipe:
        return root
    partial = root.with_name(root.name + ".partial")
    for stale in (partial, root):
        if stale.exists():
            shutil.rmtree(stale)
    partial.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                    str(partial), MIRROR], check=True, capture_output=True, text=True)
    (partial / "etc" / "hostname").write_text(HOSTNAME + "\n")
    (partial / "etc" / "hosts").write_text(HOSTS)
    (partial / STAMP).write_text(recipe)
    partial.rename(root)
    return root


def _pid1_of(nspawn_pid: int) -> int | None:
    """The container's systemd: the descendant of nspawn that is PID 1 in its own namespace
    and has exec'd systemd. Before that exec it is nspawn's child still mounting the root:
    a command entering its namespaces then would run on the host's file system."""
    children = [nspawn_pid]
    while children:
        pid = children.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspid = fields.get("NSpid", "").split()
        if pid != nspawn_pid and nspid[-1:] == ["1"] and fields["Name"].strip() == "systemd":
            return pid
        children.extend(int(k) for k in kids)
    return None


class Container:
    """A booted container: `with Container(root, binds) as c: c.sh("systemctl ...")`."""

    def __init__(self, root: Path, binds: Sequence[str] = (), ro_binds: Sequence[str] = (),
                 log: Path = CACHE / "boot.log") -> None:
        self.root = root
        self.binds = [f"--bind={b}" for b in binds] + [f"--bind-ro={b}" for b in ro_binds]
        self.log_path = log
        self.nspawn: subprocess.Popen | None = None
        self.pid1: int | None = None
        self._log: IO[str] | None = None

    def boot(self, timeout: float = 180) -> None:
        # What an nspawn killed before its halt left of its ephemeral copy (and its lock).
        for stale in self.root.parent.glob(f".#*machine.{self.root.name}*"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        self._log = open(self.log_path, "w")
        # --keep-unit --register=no: there is no host systemd to ask for a scope or a machine.
        self.nspawn = subprocess.Popen(
            ["systemd-nspawn", "--keep-unit", "--register=no", "--console=passive",
             "--ephemeral", f"--machine={HOSTNAME}", "-D", str(self.root),
             *self.binds, "-b"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while self.pid1 is None:
            if self.nspawn.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.nspawn.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the container's systemd did not start")
            time.sleep(0.2)
            self.pid1 = _pid1_of(self.nspawn.pid)
        # Until systemd's bus is up, systemctl cannot even ask: poll, do not --wait.
        while (state := self.sh("systemctl is-system-running", check=False)).stdout.strip() \
                not in ("running", "degraded"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the container's systemd is {state.stdout!r} "
                                   f"{state.stderr!r}:\n"
                                   f"{self.sh('systemctl --failed', check=False).stdout}")
            time.sleep(0.5)

    def sh(self, script: str, user: str | None = None, check: bool = True,
           timeout: float = 120) -> subprocess.CompletedProcess:
        """A bash script inside, as root or, through sudo as an operator would, as `user`.
        The environment is the container's, not the test's (no host PATH, venv or PIP_*)."""
        assert self.pid1 is not None, "boot the container first"
        command = ["bash", "-c", script]
        if user is not None:
            command = ["sudo", "-u", user, "-H", *command]
        result = subprocess.run(["nsenter", "-t", str(self.pid1), "-a", "env", "-i",
                                 f"PATH={PATH}", "HOME=/root", "LANG=C.UTF-8", *command],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"in the container{f' as {user}' if user else ''}: "
                                 f"{shlex.quote(script)} exited {result.returncode}\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def halt(self, timeout: float = 120) -> None:
        """SIGTERM to nspawn halts the container cleanly (systemd stops every unit)."""
        if self.nspawn is None:
            return
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait()
        if self._log is not None:
            self._log.close()
        self.nspawn = self.pid1 = None

    def __enter__(self) -> "Container":
        try:
            self.boot()
        except BaseException:
            self.halt()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt()


def host_pip_binds() -> list[str]:
    """Read-only binds of the host's pip setup (HOST_PIP), those that exist here."""
    return [f"{path}:{path}" for path in HOST_PIP if os.path.exists(path)]
