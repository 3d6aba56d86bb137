"""eagle3ctl's exit codes, which a monitor or a script branches on: what each means is the table
in ctl/main.py's docstring (`eagle3ctl --help` prints it)."""

FAILED, BAD_CONFIG, NOT_RUNNING = 1, 2, 3
WAITS_FOR_OPERATOR = 4
EDIT_NOT_APPLIED = 5
NEEDS_RESTART_CODE, RELOAD_REFUSED = 6, 7
SHARD_DOWN = 8
LOOP_CONDITION = 9
NOT_NOW = 75  # a request not delivered for now (EX_TEMPFAIL, as `eagle3d run`'s "not now")
