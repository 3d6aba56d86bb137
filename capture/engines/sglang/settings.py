"""The [sglang] section of the config: the SGLang server the engine starts, in the schema's
vocabulary (statemachine/config_schema.py), read and checked as its sections are. Light
(stdlib and statemachine): the daemon and eagle3ctl import it through the spec.
"""

from typing import Annotated, NamedTuple

from eagle3d.statemachine.config_schema import SECONDS, STR, str_list, typed

# No `from __future__ import annotations`: the converters are read from the annotations.


class SGLangSettings(NamedTuple):
    python: Annotated[str, STR] = "python3"
    tp: Annotated[int, typed(int, minimum=1, maximum=64)] = 1
    host: Annotated[str, STR] = "127.0.0.1"
    port: Annotated[int, typed(int, minimum=1, maximum=65535)] = 30000
    mem_fraction: Annotated[float, typed(float, minimum=0.05, maximum=0.99)] = 0.85
    startup_timeout_s: Annotated[float, SECONDS] = 1800.0
    extra_args: Annotated[tuple[str, ...], str_list] = ()
