"""`python -m eagle3d.capture.engines.sglang.serve ARGS`: `python -m sglang.launch_server ARGS` with the
API key of this start added, taken from the environment.

SGLang reads its key from the command line only (`--api-key`), and every local user reads every
process's command line (`ps`, /proc/PID/cmdline). The environment is readable by the process's
own user alone, so the daemon hands the key over there and this module adds it to SGLang's
arguments inside the process: the key never appears in a command line another user can see.
Stdlib only, and nothing but SGLang runs after it.
"""

from __future__ import annotations

import os
import runpy
import sys

# The HTTP API key of one server start (capture/engines/sglang/launcher.py makes it; the daemon's client
# and the generator send it as `Authorization: Bearer`).
API_KEY_ENV = "EAGLE3D_SGLANG_API_KEY"
SERVER_MODULE = "sglang.launch_server"


def main() -> None:
    key = os.environ.pop(API_KEY_ENV, "")
    if not key:
        sys.exit(f"{API_KEY_ENV} is not set: eagle3d never starts an SGLang server without an "
                 "API key (any local user could call it)")
    sys.argv = [SERVER_MODULE, *sys.argv[1:], "--api-key", key]
    # As `python -m`: SGLang's spawned processes find their main module by this name.
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
