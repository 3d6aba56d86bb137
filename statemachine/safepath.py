"""Folders another local user could swap: a folder is only as safe as every folder above it
(OpenSSH's safe_path). An ancestor that another user owns, or that others may write to, lets
them rename our folder away and put theirs (or a link) in its place between two of our calls."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path


def user_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` for a uid with no name: what an error shows of an owner."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def ancestor_problem(path: Path) -> str | None:
    """Why a folder above `path` lets another user swap it, or None. Each existing ancestor,
    from / down, must belong to root or to us and be writable by no one else, except a folder
    of root's with the sticky bit (/dev/shm, /tmp): there no one renames what is not theirs."""
    for folder in _chain(path):
        try:
            st = folder.lstat()
        except FileNotFoundError:
            return None  # from here down the daemon makes the folders itself
        shared = st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0)
        if not trusted_owner(st.st_uid) or shared:
            return (f"{path} lies in {folder}, which belongs to {user_name(st.st_uid)} with "
                    f"mode {stat.S_IMODE(st.st_mode):04o}: another user could swap {path} "
                    "under the daemon. Remove it (or give it to the service's user and "
                    "chmod go-w it), or point [paths] elsewhere")
    return None


def folder_problem(path: Path, mode: int) -> str | None:
    """Make `path` (and what is missing above it) with `mode`, then check it as the daemon's
    own: in no folder another user could swap, no link, written by no one else, ours. Why not,
    or None. The same at the start and when a folder is removed under the daemon."""
    problem = ancestor_problem(path)
    if problem:
        return problem
    try:
        path.mkdir(parents=True, exist_ok=True, mode=mode)
        st = path.lstat()
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink; eagle3d does not follow links in its folders"
    if st.st_mode & 0o022:
        return f"{path} is writable by its group or by everyone; run chmod go-w {path}"
    if not trusted_owner(st.st_uid):
        return (f"{path} belongs to {user_name(st.st_uid)}, not the daemon's user: remove it, "
                "or point [paths] elsewhere")
    return None


def _chain(path: Path) -> list[Path]:
    """The folders above `path`, from / down, links resolved (a link's own folder is checked
    as the folder it names)."""
    parent = Path(os.path.realpath(Path(path).parent))
    return [*reversed(parent.parents), parent]


class Unsafe(Exception):
    """A folder the daemon was to work in is not its own, or is not where it was."""


class HeldDir:
    """A folder opened once, after its path was checked, and worked through its handle from
    then on (every call below is *at(dir_fd) and follows no link): what another user does to
    the path afterwards (rename it away, put a link or a folder of theirs in its place) never
    redirects a read, a write or a delete. `path` is for messages and for `where()` alone."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = Path(path)
        self.fd = fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)

    @classmethod
    def open(cls, path: Path) -> "HeldDir":
        """`path`, checked from / down (`ancestor_problem`), then its own owner and mode on
        the opened folder itself: the folder held is the folder checked. Raises Unsafe."""
        problem = ancestor_problem(path)
        if problem:
            raise Unsafe(problem)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:  # ELOOP: a link; ENOTDIR: a file
            raise Unsafe(f"cannot open the folder {path}: {exc.strerror} (a link is never "
                         "followed)") from None
        return cls._checked(path, fd)

    @classmethod
    def _checked(cls, path: Path, fd: int) -> "HeldDir":
        st = os.fstat(fd)
        problem = (f"belongs to {user_name(st.st_uid)}" if not trusted_owner(st.st_uid) else
                   f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
                   if st.st_mode & 0o022 else None)
        if problem:
            os.close(fd)
            raise Unsafe(f"{path} {problem}: another user could plant or swap files in it")
        return cls(path, fd)

    def subdir(self, name: str, mode: int) -> "HeldDir":
        """The sub-folder `name`, made if missing, held like this one. Raises Unsafe."""
        try:
            os.mkdir(name, mode, dir_fd=self.fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except OSError as exc:
            raise Unsafe(f"cannot open the folder {self.path / name}: {exc.strerror}") from None
        return self._checked(self.path / name, fd)

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """A file in the folder; never a link, and never waiting on a FIFO's writer."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode,
                       dir_fd=self.fd)

    def stat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def rename(self, name: str, to: "HeldDir", new_name: str) -> None:
        os.rename(name, new_name, src_dir_fd=self.fd, dst_dir_fd=to.fd)

    def entries(self) -> list[tuple[str, os.stat_result]]:
        """Every entry with its own stat (a link's, not its target's); one gone between the
        listing and its stat is left out. A fresh open of "." per listing: threads sharing
        the handle never share a read position."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        out = []
        for name in names:
            try:
                out.append((name, self.stat(name)))
            except FileNotFoundError:
                pass
        return out

    def where(self) -> str:
        """"held" while the path still names the folder held, "removed" when nothing is there,
        "replaced" when something else is (a link, another folder): the daemon then works on in
        the folder it holds and never on what the path names now."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "removed"
        return "held" if (st.st_dev, st.st_ino) == self.ident else "replaced"

    def close(self) -> None:
        os.close(self.fd)
