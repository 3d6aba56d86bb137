"""Process lifetime on Linux: a child that must not outlive its parent asks the kernel for it."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies. torchrun starts its
    ranks in sessions of their own, so a kill -9 of the daemon (and with it torchrun) would
    otherwise leave the ranks running as orphans."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
