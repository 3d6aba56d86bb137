"""The SGLang engine's decoder for the generator child ([data] responses = "target"): the
generate stage's server (spec.generation_server), one conversation's turn per request, many in
flight (capture/generator.py, _write_streaming).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from eagle3d.capture.engines.sglang import client
from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
from eagle3d.capture.engines.sglang.spec import SETTINGS
from eagle3d.statemachine.config_schema import Config, GenerateConfig
from eagle3d.statemachine.entry import Refusal
from eagle3d.target import loading

log = logging.getLogger("eagle3d.generator")


class SGLangDecoder:
    """The generate stage's SGLang server (daemon/stages/generate.py starts it): one /generate
    for the prompts given, each with its own room and seed (the generator gives it one
    conversation's turn at a time, from many threads)."""

    def __init__(self, base_url: str, api_key: str, eos: set[int],
                 settings: GenerateConfig) -> None:
        self.base_url, self.api_key, self.eos, self.settings = base_url, api_key, eos, settings

    def __call__(self, prompts: list[list[int]], rooms: list[int], seed: int) -> list[list[int]]:
        greedy = self.settings.temperature <= 0
        sampling = [{"max_new_tokens": room, "stop_token_ids": sorted(self.eos),
                     "temperature": 0.0 if greedy else self.settings.temperature,
                     "top_p": 1.0 if greedy else self.settings.top_p,
                     **({} if greedy else {"sampling_seed": seed + i})}
                    for i, room in enumerate(rooms)]
        return client.generate(self.base_url, self.api_key, prompts, sampling)


def connect(cfg: Config, tokenizer: Any) -> tuple[SGLangDecoder, set[int]]:
    """The decoder of the generation server, once it answers, and the tokens that end an answer."""
    eos = loading.stop_tokens(tokenizer, loading.load_generation_config(cfg.target.model_path))
    server = SETTINGS.of(cfg)
    url = f"http://{server.host}:{server.port}"
    deadline = time.monotonic() + server.startup_timeout_s
    log.info("waiting for the SGLang generation server at %s", url)
    while not client.healthy(url, client.HEALTH_TIMEOUT_S):
        if time.monotonic() > deadline:
            raise Refusal(f"the SGLang generation server at {url} did not answer /health "
                          f"within [sglang] startup_timeout_s = "
                          f"{server.startup_timeout_s:.0f} s; see the daemon's log")
        time.sleep(client.HEALTH_EVERY_S)
    # The server's API key, from the daemon that started it (the environment: no other user
    # reads it there).
    key = os.environ.get(API_KEY_ENV, "")
    # The weights of this path were checked against the contract at the start.
    client.check_serves(url, str(cfg.target.model_path), key)
    return SGLangDecoder(url, key, eos, cfg.generate), eos
