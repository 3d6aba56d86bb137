"""The capture plugin that runs inside SGLang's scheduler processes (one per tensor-parallel
rank), loaded through SGLang's own plugin mechanism: the `sglang.srt.plugins` entry point
`eagle3d_capture` (pyproject.toml) names `register`, which SGLang's `load_plugins()` calls in
every process it starts, and the hooks it registers are applied by SGLang's `HookRegistry`.

For every EXTEND (prefill) forward, and no other mode, it takes the EAGLE-3 aux hidden states and
the post-norm final hidden state, splits them per request and writes one dump per request into
the spool, named by the request id (= the sample id). With tensor parallelism every rank holds
the same full hidden states, and rank 0 alone writes.

The part that touches SGLang is the last section of this module and is as thin as possible;
everything above it is plain torch and tested here. Written against the source of sglang 0.5.14
and 0.5.23 (names cited where used); supported range in capture/sglang_launcher.py.

The dump's loss mask is not known inside SGLang (a request carries token ids only), so the writer
reads it, with the planned token count, from the ledger's plan (read-only). That lookup also
tells our requests from others (SGLang's warm-up and health checks use their own request ids).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from eagle3d.capture import dumpformat, layers

log = logging.getLogger("eagle3d.capture")

# What the launcher tells the plugin, through the server's environment.
ENV_SPOOL = "EAGLE3D_SPOOL"          # folder the dumps go to
ENV_CONTRACT = "EAGLE3D_CONTRACT"    # the capture contract's fingerprint, stamped on every dump
ENV_LAYER_IDS = "EAGLE3D_LAYER_IDS"  # the contract's layer ids, in the contract's convention
ENV_LEDGER = "EAGLE3D_LEDGER"        # the ledger, for each sample's loss mask
PLUGIN_NAME = "eagle3d_capture"      # the entry point's name (pyproject.toml)
ENTRY_POINT_GROUP = "sglang.srt.plugins"

# SGLang targets, as dotted paths for HookRegistry.register (sglang/srt/plugins/hook_registry.py).
LOAD_MODEL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
LOGITS_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
# LogitsProcessor.forward(self, input_ids, hidden_states, lm_head, logits_metadata,
#                         aux_hidden_states=None, ...) in sglang/srt/layers/logits_processor.py.
LOGITS_ARGS = ("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")

SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16",
                      "torch.int32": "I32", "torch.uint8": "U8"}
WRITE_QUEUE_BATCHES = 4  # forward batches waiting for the writer before a forward waits


class CaptureError(RuntimeError):
    """SGLang handed the plugin something it cannot capture correctly: stop loudly."""


@dataclass(frozen=True)
class CaptureSettings:
    spool: Path
    contract: str
    layer_ids: tuple[int, ...]
    ledger: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CaptureSettings | None:
        """None when the launcher did not set the plugin up: an SGLang server started by anyone
        else, in an environment where eagle3d happens to be installed, is left alone."""
        if not env.get(ENV_SPOOL):
            return None
        missing = [k for k in (ENV_CONTRACT, ENV_LAYER_IDS, ENV_LEDGER) if not env.get(k)]
        if missing:
            raise CaptureError(f"{ENV_SPOOL} is set but {', '.join(missing)} is not")
        try:
            ids = tuple(int(v) for v in env[ENV_LAYER_IDS].split(","))
        except ValueError:
            raise CaptureError(f"{ENV_LAYER_IDS}={env[ENV_LAYER_IDS]!r} is not a comma-separated "
                               "list of layer ids") from None
        return cls(Path(env[ENV_SPOOL]), env[ENV_CONTRACT], ids, Path(env[ENV_LEDGER]))

    def to_env(self) -> dict[str, str]:
        return {ENV_SPOOL: str(self.spool), ENV_CONTRACT: self.contract,
                ENV_LAYER_IDS: ",".join(map(str, self.layer_ids)), ENV_LEDGER: str(self.ledger)}


# ---- pure: one forward batch → per-request slices ----------------------------------------------

@dataclass(frozen=True)
class RequestSlice:
    rid: str
    prefix_len: int    # tokens already in the KV cache before this forward (0 for a whole prefill)
    input_ids: Any     # torch.Tensor [T]
    aux_hidden: Any    # torch.Tensor [T, K*H], the K captured layers side by side
    last_hidden: Any   # torch.Tensor [T, H], after the final norm


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def split_extend_batch(forward_mode_is_extend: bool, rids: Sequence[str], extend_start_loc: Any,
                       extend_seq_lens: Any, input_ids: Any, aux_hidden: Any, last_hidden: Any,
                       extend_prefix_lens: Any = None) -> list[RequestSlice]:
    """Cut one forward batch into its requests. SGLang lays an EXTEND batch out as the requests'
    new tokens end to end: request i owns rows [extend_start_loc[i], + extend_seq_lens[i]) of
    `input_ids` and of every hidden state (rows past the last request are padding). `aux_hidden`
    is one [N, K*H] tensor or a list of K [N, H] tensors (SGLang passes either, by model).
    Any other forward mode yields nothing: its rows are not a prompt's prefill."""
    if not forward_mode_is_extend:
        return []
    import torch
    if aux_hidden is None or isinstance(aux_hidden, (list, tuple)) and not aux_hidden:
        raise CaptureError("the model captured no aux hidden states "
                           "(set_eagle3_layers_to_capture was not applied)")
    if isinstance(aux_hidden, (list, tuple)):
        aux_hidden = torch.cat(list(aux_hidden), dim=-1)
    starts, lens = _ints(extend_start_loc), _ints(extend_seq_lens)
    prefixes = _ints(extend_prefix_lens) if extend_prefix_lens is not None else [0] * len(lens)
    if not len(rids) == len(starts) == len(lens) == len(prefixes):
        raise CaptureError(f"batch fields disagree: {len(rids)} request ids, {len(starts)} start "
                           f"locations, {len(lens)} lengths, {len(prefixes)} prefix lengths")
    if last_hidden.dim() != 2 or aux_hidden.dim() != 2 or input_ids.dim() != 1:
        raise CaptureError(f"unexpected ranks: input_ids {tuple(input_ids.shape)}, aux "
                           f"{tuple(aux_hidden.shape)}, last {tuple(last_hidden.shape)}")
    if aux_hidden.shape[1] % last_hidden.shape[1]:
        raise CaptureError(f"aux hidden width {aux_hidden.shape[1]} is not a multiple of the "
                           f"hidden size {last_hidden.shape[1]}")
    end = max((s + n for s, n in zip(starts, lens)), default=0)
    rows = min(input_ids.shape[0], aux_hidden.shape[0], last_hidden.shape[0])
    if end > rows:
        raise CaptureError(f"requests span {end} tokens but the batch holds {rows} rows "
                           "(hidden states sharded or pruned before the logits processor?)")
    return [RequestSlice(rid, prefix, input_ids[s:s + n], aux_hidden[s:s + n],
                         last_hidden[s:s + n])
            for rid, s, n, prefix in zip(rids, starts, lens, prefixes)]


# ---- writing dumps -----------------------------------------------------------------------------

def _entry(t: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """A tensor as the dump writer takes it. bf16 has no numpy dtype, so the bytes go through a
    uint8 view."""
    import torch
    dtype = SAFETENSORS_DTYPES.get(str(t.dtype))
    if dtype is None:
        raise CaptureError(f"cannot store a {t.dtype} tensor in a dump")
    raw = t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
    return dtype, tuple(t.shape), memoryview(raw)


def dump_tensors(s: RequestSlice, loss_mask: bytes) -> dict[str, tuple[str, tuple[int, ...],
                                                                      memoryview | bytes]]:
    import torch
    tokens = s.input_ids.shape[0]
    if len(loss_mask) != tokens:
        raise CaptureError(f"{s.rid}: loss mask of {len(loss_mask)} tokens for {tokens} tokens")
    return {"input_ids": _entry(s.input_ids.to(torch.int32)),
            "loss_mask": ("U8", (tokens,), loss_mask),
            "aux_hidden_states": _entry(s.aux_hidden),
            "last_hidden_state": _entry(s.last_hidden)}


LossMasks = Callable[[str], "bytes | None"]


def ledger_loss_masks(ledger_path: Path) -> LossMasks:
    """Loss masks from the ledger's plan; None for a request id that is not a planned sample."""
    from eagle3d.statemachine.ledger import Ledger
    ledger = Ledger(ledger_path, readonly=True)

    def lookup(sid: str) -> bytes | None:
        found = ledger.plan_tokens([sid]).get(sid)
        return found[1] if found else None
    return lookup


class DumpWriter:
    """Writes dumps on a thread of its own, so the forward pass does not wait on the disk; a
    bounded queue makes the forward wait when the disk cannot keep up, instead of piling up
    hidden states in host memory."""

    def __init__(self, spool: Path, contract: str, loss_masks: LossMasks) -> None:
        self.spool = Path(spool)
        self.contract = contract
        self.loss_masks = loss_masks
        self.written = 0
        self._queue: queue.Queue[list[RequestSlice] | None] = queue.Queue(WRITE_QUEUE_BATCHES)
        self._thread = threading.Thread(target=self._run, name="eagle3d-dumps", daemon=True)
        self._thread.start()

    def put(self, slices: list[RequestSlice]) -> None:
        self._queue.put(slices)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for s in batch:
                try:
                    self.write(s)
                except Exception:  # one bad dump must not stop the others or the server
                    log.exception("eagle3d capture: no dump for request %s", s.rid)
            self._queue.task_done()
        self._queue.task_done()

    def write(self, s: RequestSlice) -> Path | None:
        mask = self.loss_masks(s.rid)
        if mask is None:
            return None  # not a planned sample: SGLang's own warm-up or another client
        path = dumpformat.write_dump(self.spool, s.rid, self.contract, dump_tensors(s, mask))
        self.written += 1
        return path


class Capture:
    """What the writing rank does with each forward batch."""

    def __init__(self, writer: DumpWriter, num_layers: int) -> None:
        self.writer = writer
        self.num_layers = num_layers

    def on_forward(self, forward_mode_is_extend: bool, rids: Sequence[str] | None,
                   extend_start_loc: Any, extend_seq_lens: Any, extend_prefix_lens: Any,
                   input_ids: Any, aux_hidden: Any, last_hidden: Any) -> int:
        """Queue this batch's dumps; returns how many requests were queued."""
        if not forward_mode_is_extend or not rids:
            return 0
        if not any(dumpformat.SAMPLE_ID.fullmatch(r or "") for r in rids):
            return 0  # health checks and warm-up: nothing to copy off the GPU
        if isinstance(aux_hidden, (list, tuple)) and len(aux_hidden) != self.num_layers:
            raise CaptureError(f"the model captured {len(aux_hidden)} layers, the contract "
                               f"names {self.num_layers}")
        slices = split_extend_batch(True, rids, extend_start_loc, extend_seq_lens,
                                    input_ids.to("cpu"), _to_cpu(aux_hidden),
                                    last_hidden.to("cpu"), extend_prefix_lens)
        width = slices[0].aux_hidden.shape[1] if slices else 0
        if slices and width != self.num_layers * slices[0].last_hidden.shape[1]:
            raise CaptureError(f"aux hidden width {width} is not {self.num_layers} layers of "
                               f"{slices[0].last_hidden.shape[1]}")
        keep = []
        for s in slices:
            if not dumpformat.SAMPLE_ID.fullmatch(s.rid or ""):
                continue
            if s.prefix_len:
                # A cached or chunked prefix: these rows are not the whole prompt.
                log.error("eagle3d capture: request %s reused %d cached tokens; no dump (is the "
                          "radix cache or chunked prefill on?)", s.rid, s.prefix_len)
                continue
            keep.append(s)
        if keep:
            self.writer.put(keep)
        return len(keep)


def _to_cpu(aux_hidden: Any) -> Any:
    if aux_hidden is None:
        return None
    if isinstance(aux_hidden, (list, tuple)):
        return [t.to("cpu") for t in aux_hidden]
    return aux_hidden.to("cpu")


# ---- the SGLang glue ---------------------------------------------------------------------------
# Not run here (no GPU, no SGLang): docs/sglang.md says what was read and what the smoke test runs.

_capture: Capture | None = None
_settings: CaptureSettings | None = None


def register() -> None:
    """The entry point SGLang's `load_plugins()` (sglang/srt/plugins/__init__.py) calls in each
    of its processes; the hooks take effect in the scheduler processes, which run the model."""
    global _settings
    _settings = CaptureSettings.from_env(os.environ)
    if _settings is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(LOAD_MODEL_TARGET, _after_load_model, HookType.AFTER)
    HookRegistry.register(LOGITS_TARGET, _before_logits, HookType.BEFORE)


def _after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ModelRunner.load_model (model_executor/model_runner.py): switch the target's aux
    capture on, as SGLang's own EAGLE-3 path does for a speculative target, and read back what
    the model will capture: a mismatch stops the server instead of writing wrong layers."""
    global _capture
    assert _settings is not None
    if getattr(model_runner, "is_draft_worker", False):
        return
    model = model_runner.model
    names = [c.__name__ for c in type(model).__mro__]
    arch = layers.known_architecture(names)
    if arch is None:
        raise CaptureError(f"eagle3d capture: no known layer-id convention for {names[0]}")
    model.set_eagle3_layers_to_capture(layers.sglang_layer_ids(list(_settings.layer_ids), arch))
    inner = getattr(model, "language_model", None) or model  # Kimi-K2.5 wraps a DeepSeek-V3
    pp_group = getattr(inner, "pp_group", None)
    if pp_group is None or pp_group.is_last_rank:
        captured = list(inner.model.layers_to_capture)
        if captured != list(_settings.layer_ids):
            raise CaptureError(f"eagle3d capture: {names[0]} captures the inputs of layers "
                               f"{captured}, the contract names {list(_settings.layer_ids)}")
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
    if get_tensor_model_parallel_rank() == 0:
        _settings.spool.mkdir(parents=True, exist_ok=True)
        writer = DumpWriter(_settings.spool, _settings.contract,
                            ledger_loss_masks(_settings.ledger))
        _capture = Capture(writer, len(_settings.layer_ids))
        log.info("eagle3d capture: %s, layers %s, dumps to %s", names[0],
                 list(_settings.layer_ids), _settings.spool)


def _before_logits(processor: Any, *args: Any, **kwargs: Any) -> None:
    """Before LogitsProcessor.forward, which every supported model calls with the post-norm
    hidden states of all the batch's tokens and, once capture is on, its aux hidden states."""
    if _capture is None:
        return
    bound = dict(zip(LOGITS_ARGS, args))
    bound.update(kwargs)
    batch = bound.get("logits_metadata")
    rids = getattr(batch, "rids", None)  # a ForwardBatch (model_executor/forward_batch_info.py)
    if rids is None:
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    _capture.on_forward(batch.forward_mode == ForwardMode.EXTEND, rids, batch.extend_start_loc,
                        batch.extend_seq_lens, batch.extend_prefix_lens_cpu, batch.input_ids,
                        bound.get("aux_hidden_states"), bound["hidden_states"])
