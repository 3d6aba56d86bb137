"""Transitional, for the commit that moves the code only: the schema is
statemachine/config_schema.py, reading and validating a file statemachine/config_validation.py.
The next commit points every import at the module that owns the name and removes this file."""

from eagle3d.statemachine.config_schema import *  # noqa: F401,F403
from eagle3d.statemachine.config_schema import INT64_MAX  # noqa: F401
from eagle3d.statemachine.config_validation import *  # noqa: F401,F403
from eagle3d.statemachine.config_validation import MAX_CONFIG_BYTES  # noqa: F401
