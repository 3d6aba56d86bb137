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
