"""The capture plugin that runs inside SGLang's scheduler processes (one per tensor-parallel
rank), loaded through SGLang's own plugin mechanism: the `sglang.srt.plugins` entry point
`eagle3d_capture` (pyproject.toml) names `register`, which SGLang's `load_plugins()` calls in
every process it starts, and the hooks it registers are applied by SGLang's `HookRegistry`.

For every EXTEND (prefill) forward, and no other mode, it takes the EAGLE-3 aux hidden states and
the post-norm final hidden state, casts or quantizes them to the contract's dump dtype on the GPU
(precision.py; fp8 halves what is copied to the host), splits them per request and writes one
dump per request into the spool, named by the request id (= the sample id). With tensor
parallelism every rank holds the same full hidden states, and rank 0 alone writes.

The part that touches SGLang is the last section of this module and is as thin as possible;
everything above it is plain torch and tested here. Written against the source of sglang 0.5.14
and 0.5.23 (names cited where used), run inside 0.5.17; supported range in
capture/engines/sglang/launcher.py.

The dump's loss mask is not known inside SGLang (a request carries token ids only), so the writer
reads it, with the planned token count, from the ledger's plan (read-only). That lookup also
tells our requests from others (SGLang's warm-up and health checks use their own request ids).
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from eagle3d.capture.engines.sglang.spec import ENV_REQUEST_KEY, ENV_TOKEN, NAME, SPOT_PREFIX
from eagle3d.dataset import dumpformat
from eagle3d.dataset.dumpformat import AUX, LAST
from eagle3d.statemachine import layout
from eagle3d.statemachine.entry import ContractMismatch
from eagle3d.target import identity, layers
from eagle3d.target.loading import fingerprint_file_or_folder

log = logging.getLogger("eagle3d.capture")

# What the launcher tells the plugin, through the server's environment.
ENV_SPOOL = "EAGLE3D_SPOOL"          # folder the dumps go to
ENV_CONTRACT = "EAGLE3D_CONTRACT"    # the capture contract's fingerprint, stamped on every dump
ENV_LAYER_IDS = "EAGLE3D_LAYER_IDS"  # the contract's layer ids, in the contract's convention
ENV_LEDGER = "EAGLE3D_LEDGER"        # the ledger, for each sample's loss mask
ENV_DUMP_DTYPE = "EAGLE3D_DUMP_DTYPE"  # the contract's dump dtype: how a dump stores the states
# ENV_TOKEN and ENV_REQUEST_KEY, which the daemon reads too, are the spec's.
# Rank 0 writes this once capture is set up; the daemon declares the engine ready only after
# reading it.
HANDSHAKE_FILE = layout.engine_handshake(NAME)

# SGLang targets, as dotted paths for HookRegistry.register (sglang/srt/plugins/hook_registry.py).
LOAD_MODEL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
LOGITS_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
# LogitsProcessor.forward(self, input_ids, hidden_states, lm_head, logits_metadata,
#                         aux_hidden_states=None, ...) in sglang/srt/layers/logits_processor.py.
LOGITS_ARGS = ("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")

# A request id SPOT_PREFIX + sample id is the daemon's spot check re-extracting a verified
# sample: its dump goes to SPOT_FOLDER, out of ingest's sight (it would be a duplicate there).
SPOT_FOLDER = layout.engine_spot_folder(NAME)
# A dump the plugin could not write leaves `<sample id>.<kind>` here, an empty file (an inode,
# no data: it is made on a full tmpfs too), kind "disk_full" (ENOSPC, EDQUOT) or "write_failed"
# (any other error of the file system): the daemon returns the sample at once, without an
# attempt, as the transformers worker's error event of that kind does, instead of waiting for
# [extract] inflight_timeout_s.
FAILED_FOLDER = layout.engine_failed_folder(NAME)

WRITE_QUEUE_BATCHES = 4  # forward batches waiting for the writer before a forward waits


class CaptureError(RuntimeError):
    """SGLang handed the plugin something it cannot capture correctly: stop loudly."""


@dataclass(frozen=True)
class CaptureSettings:
    spool: Path
    contract: str
    layer_ids: tuple[int, ...]
    ledger: Path
    dump_dtype: str
    token: str = ""
    request_key: str = ""  # "": no key asked (the launcher always sets one)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CaptureSettings | None:
        """None when the launcher did not set the plugin up: an SGLang server started by anyone
        else, in an environment where eagle3d happens to be installed, is left alone."""
        if not env.get(ENV_SPOOL):
            return None
        missing = [k for k in (ENV_CONTRACT, ENV_LAYER_IDS, ENV_LEDGER, ENV_DUMP_DTYPE)
                   if not env.get(k)]
        if missing:
            raise CaptureError(f"{ENV_SPOOL} is set but {', '.join(missing)} is not")
        try:
            ids = tuple(int(v) for v in env[ENV_LAYER_IDS].split(","))
        except ValueError:
            raise CaptureError(f"{ENV_LAYER_IDS}={env[ENV_LAYER_IDS]!r} is not a comma-separated "
                               "list of layer ids") from None
        return cls(Path(env[ENV_SPOOL]), env[ENV_CONTRACT], ids, Path(env[ENV_LEDGER]),
                   env[ENV_DUMP_DTYPE], env.get(ENV_TOKEN, ""), env.get(ENV_REQUEST_KEY, ""))

    def to_env(self) -> dict[str, str]:
        return {ENV_SPOOL: str(self.spool), ENV_CONTRACT: self.contract,
                ENV_LAYER_IDS: ",".join(map(str, self.layer_ids)), ENV_LEDGER: str(self.ledger),
                ENV_DUMP_DTYPE: self.dump_dtype, ENV_TOKEN: self.token,
                ENV_REQUEST_KEY: self.request_key}


# ---- pure: one forward batch → per-request slices ----------------------------------------------

@dataclass(frozen=True)
class RequestSlice:
    rid: str
    prefix_len: int    # tokens already in the KV cache before this forward (0 for a whole prefill)
    input_ids: Any     # torch.Tensor [T]
    # The dump's hidden-state tensors on the host, by name, in the dump dtype: aux [T, K*H] (the
    # K captured layers side by side) and last [T, H] (after the final norm), with fp8 also
    # their scales [T, K] and [T, 1].
    states: dict[str, Any]


@dataclass(frozen=True)
class HostBatch:
    """One forward batch's requests, on their way to the host: their rows may be read only after
    `arrived()` returns (the device-to-host copy runs behind the forward)."""
    slices: list[RequestSlice]
    arrived: Callable[[], None]


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def copy_to_host(tensors: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Host copies of `tensors` and a function that returns once they hold the data. On a GPU
    the copy goes into pinned memory without blocking, queued on the forward's own stream (so it
    reads the states before any later kernel can change them) and the forward runs on at once:
    a synchronous copy made SGLang's scheduler wait for the GPU on every prefill."""
    import torch
    if not any(t.is_cuda for t in tensors.values()):
        return {k: t.to("cpu") for k, t in tensors.items()}, lambda: None
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for k, t in tensors.items()}
    done = torch.cuda.Event()
    done.record()
    return host, done.synchronize


def split_extend_batch(forward_mode_is_extend: bool, rids: Sequence[str], extend_seq_lens: Any,
                       input_ids: Any, aux_hidden: Any, last_hidden: Any,
                       extend_prefix_lens: Any, dump_dtype: str) -> HostBatch:
    """Cut one forward batch into its requests. SGLang lays an EXTEND batch out as the requests'
    new tokens end to end: request i owns the `extend_seq_lens[i]` rows after the requests
    before it, of `input_ids` and of every hidden state (rows past the last request are
    padding). The lengths are SGLang's host copy (`extend_seq_lens_cpu`): reading its device
    tensors here would wait for the GPU. `aux_hidden` is one [N, K*H] tensor or a list of K
    [N, H] tensors (SGLang passes either, by model). The states are encoded in `dump_dtype` where
    they are (the GPU) and copied to the host once for the whole batch. Any other forward mode
    yields nothing: its rows are not a prompt's prefill."""
    if not forward_mode_is_extend:
        return HostBatch([], lambda: None)
    import torch
    # Imported here, as torch is: eagle3ctl imports this module (through the launcher) and no
    # numpy.
    from eagle3d.dataset import precision
    if aux_hidden is None or isinstance(aux_hidden, (list, tuple)) and not aux_hidden:
        raise CaptureError("the model captured no aux hidden states "
                           "(set_eagle3_layers_to_capture was not applied)")
    if isinstance(aux_hidden, (list, tuple)):
        aux_hidden = torch.cat(list(aux_hidden), dim=-1)
    lens, prefixes = _ints(extend_seq_lens), _ints(extend_prefix_lens)
    if not len(rids) == len(lens) == len(prefixes):
        raise CaptureError(f"batch fields disagree: {len(rids)} request ids, {len(lens)} "
                           f"lengths, {len(prefixes)} prefix lengths")
    if last_hidden.dim() != 2 or aux_hidden.dim() != 2 or input_ids.dim() != 1:
        raise CaptureError(f"unexpected ranks: input_ids {tuple(input_ids.shape)}, aux "
                           f"{tuple(aux_hidden.shape)}, last {tuple(last_hidden.shape)}")
    if aux_hidden.shape[1] % last_hidden.shape[1]:
        raise CaptureError(f"aux hidden width {aux_hidden.shape[1]} is not a multiple of the "
                           f"hidden size {last_hidden.shape[1]}")
    starts = list(itertools.accumulate(lens, initial=0))
    rows = min(input_ids.shape[0], aux_hidden.shape[0], last_hidden.shape[0])
    if starts[-1] > rows:
        raise CaptureError(f"requests span {starts[-1]} tokens but the batch holds {rows} rows "
                           "(hidden states sharded or pruned before the logits processor?)")
    host, arrived = copy_to_host({"input_ids": input_ids, **precision.encode_states(
        aux_hidden, last_hidden, dump_dtype)})
    ids = host.pop("input_ids")
    return HostBatch([RequestSlice(rid, prefix, ids[s:s + n],
                                   {k: t[s:s + n] for k, t in host.items()})
                      for rid, s, n, prefix in zip(rids, starts, lens, prefixes)], arrived)


# ---- writing dumps -----------------------------------------------------------------------------

def request_id(key: str, name: str) -> str:
    """The request id the daemon sends for `name` (a sample id, or SPOT_PREFIX and one) to the
    server started with the request key `key`."""
    return f"{key}-{name}" if key else name


def request_sample(rid: str | None, key: str) -> tuple[str, str] | None:
    """(sample id, folder under the spool) of a request the plugin dumps; None for any other
    request (SGLang's health checks and warm-up, another client, one without this start's
    request key)."""
    rid = rid or ""
    if key:
        if not rid.startswith(f"{key}-"):
            return None
        rid = rid[len(key) + 1:]
    folder = ""
    if rid.startswith(SPOT_PREFIX):
        rid, folder = rid[len(SPOT_PREFIX):], SPOT_FOLDER
    return (rid, folder) if dumpformat.SAMPLE_ID.fullmatch(rid) else None


def dump_tensors(s: RequestSlice, loss_mask: bytes) -> dict[str, tuple[str, tuple[int, ...],
                                                                      memoryview | bytes]]:
    import torch
    from eagle3d.dataset import precision
    tokens = s.input_ids.shape[0]
    if len(loss_mask) != tokens:
        raise CaptureError(f"{s.rid}: loss mask of {len(loss_mask)} tokens for {tokens} tokens")
    return {"input_ids": precision.dump_entry(s.input_ids.to(torch.int32)),
            "loss_mask": ("U8", (tokens,), loss_mask),
            **{name: precision.dump_entry(t) for name, t in s.states.items()}}


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

    def __init__(self, spool: Path, contract: str, loss_masks: LossMasks,
                 request_key: str = "") -> None:
        self.spool = Path(spool)
        self.contract = contract
        self.loss_masks = loss_masks
        self.request_key = request_key
        self.written = 0
        self._queue: queue.Queue[HostBatch | None] = queue.Queue(WRITE_QUEUE_BATCHES)
        self._thread = threading.Thread(target=self._run, name="eagle3d-dumps", daemon=True)
        self._thread.start()

    def put(self, batch: HostBatch) -> None:
        self._queue.put(batch)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for s in batch.slices:
                try:
                    batch.arrived()  # the first call waits for the copy, the others return
                    self.write(s)
                except OSError as exc:  # the disk's fault, never the sample's: the daemon hears
                    self.report_failure(s, exc)
                except Exception:  # one bad dump must not stop the others or the server
                    log.exception("eagle3d capture: no dump for request %s", s.rid)
            self._queue.task_done()
        self._queue.task_done()

    def sample_of(self, rid: str | None) -> tuple[str, str] | None:
        return request_sample(rid, self.request_key)

    def report_failure(self, s: RequestSlice, exc: OSError) -> None:
        """Leave the failed write's marker in FAILED_FOLDER (a spot check's failure is left
        to its own timeout)."""
        kind = "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "write_failed"
        log.error("eagle3d capture: no dump for request %s (%s): %s", s.rid, kind, exc)
        found = self.sample_of(s.rid)
        if found is None or found[1]:
            return
        folder = self.spool / FAILED_FOLDER
        try:
            folder.mkdir(parents=True, exist_ok=True)
            os.close(os.open(folder / f"{found[0]}.{kind}", os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as marker:  # a read-only spool: the daemon's timeout is all that is left
            log.error("eagle3d capture: cannot report it either: %s", marker)

    def write(self, s: RequestSlice) -> Path | None:
        found = self.sample_of(s.rid)
        mask = self.loss_masks(found[0]) if found else None
        if found is None or mask is None:
            return None  # not a planned sample: SGLang's own warm-up or another client
        sid, sub = found
        folder = self.spool / sub
        folder.mkdir(parents=True, exist_ok=True)
        path = dumpformat.write_dump(folder, sid, self.contract, dump_tensors(s, mask))
        self.written += 1
        return path


class Capture:
    """What the writing rank does with each forward batch."""

    def __init__(self, writer: DumpWriter, num_layers: int, radix_cache_off: bool,
                 dump_dtype: str) -> None:
        self.writer = writer
        self.num_layers = num_layers
        self.radix_cache_off = radix_cache_off
        self.dump_dtype = dump_dtype

    def on_forward(self, forward_mode_is_extend: bool, rids: Sequence[str] | None,
                   extend_seq_lens: Any, extend_prefix_lens: Any,
                   input_ids: Any, aux_hidden: Any, last_hidden: Any) -> int:
        """Queue this batch's dumps; returns how many requests were queued."""
        if not forward_mode_is_extend or not rids:
            return 0
        if not any(self.writer.sample_of(r) for r in rids):
            return 0  # health checks and warm-up: nothing to copy off the GPU
        if extend_seq_lens is None:
            raise CaptureError("SGLang gave an EXTEND batch without host-side lengths "
                               "(extend_seq_lens_cpu is None)")
        if extend_prefix_lens is None:
            # SGLang leaves extend_prefix_lens_cpu unset on some paths (GPU-only batches). Zero
            # cached tokens is then known only because the radix cache is off, nothing else.
            if not self.radix_cache_off:
                raise CaptureError("SGLang gave no prefix lengths (extend_prefix_lens_cpu is None) "
                                   "and the radix cache is on: a request that reused a cached "
                                   "prefix would be dumped without it")
            extend_prefix_lens = [0] * len(rids)
        if isinstance(aux_hidden, (list, tuple)) and len(aux_hidden) != self.num_layers:
            raise CaptureError(f"the model captured {len(aux_hidden)} layers, the contract "
                               f"names {self.num_layers}")
        batch = split_extend_batch(True, rids, extend_seq_lens, input_ids, aux_hidden,
                                   last_hidden, extend_prefix_lens, self.dump_dtype)
        slices = batch.slices
        width = slices[0].states[AUX].shape[1] if slices else 0
        if slices and width != self.num_layers * slices[0].states[LAST].shape[1]:
            raise CaptureError(f"aux hidden width {width} is not {self.num_layers} layers of "
                               f"{slices[0].states[LAST].shape[1]}")
        keep = []
        for s in slices:
            if not self.writer.sample_of(s.rid):
                continue
            if s.prefix_len:
                # A cached or chunked prefix: these rows are not the whole prompt.
                log.error("eagle3d capture: request %s reused %d cached tokens; no dump (is the "
                          "radix cache or chunked prefill on?)", s.rid, s.prefix_len)
                continue
            keep.append(s)
        if keep:
            self.writer.put(HostBatch(keep, batch.arrived))
        return len(keep)


# ---- what the server must be for capture to be correct -----------------------------------------

def configuration_problems(server_args: Any, attn_dp_size: int) -> list[str]:
    """What in a server's resolved arguments (SGLang's ServerArgs, after its own overrides, which
    can switch features on behind the command line) the plugin cannot capture correctly; empty
    when none. Read with defaults: a field an SGLang version lacks is a feature it lacks."""
    def arg(name: str, default: Any = None) -> Any:
        return getattr(server_args, name, default)
    problems = []
    if attn_dp_size != 1 or arg("enable_dp_attention", False):
        problems.append(f"attention data parallelism (attention-DP size {attn_dp_size}): each "
                        "DP group schedules its own batches, and rank 0 would dump only its own")
    if (arg("attn_cp_size", 1) or 1) > 1 or arg("enable_prefill_cp", False) \
            or arg("enable_prefill_context_parallel", False):
        problems.append("attention context parallelism: a prompt's rows are split over ranks")
    if arg("enable_layernorm_sp", False):
        problems.append("sequence-parallel norms: rows reach the logits processor sharded")
    if arg("enable_attn_tp_input_scattered", False):
        problems.append("scattered attention-TP inputs: rows reach the logits processor sharded")
    if not arg("disable_radix_cache", False):
        problems.append("the radix cache is on: a request with a cached prefix is prefilled "
                        "only past it")
    if (arg("chunked_prefill_size", -1) or -1) > 0 or arg("enable_mixed_chunk", False):
        problems.append("chunked prefill: a prompt would be split over several forwards")
    prefill_graphs = getattr(getattr(arg("cuda_graph_config"), "prefill", None), "backend",
                             "disabled")
    if str(prefill_graphs) != "disabled":
        problems.append(f"prefill CUDA graphs ({prefill_graphs}): a replay bypasses the hook")
    if (arg("pp_size", 1) or 1) > 1:
        problems.append("pipeline parallelism: the writing rank holds no final hidden states")
    if arg("speculative_algorithm"):
        problems.append("speculative decoding: the target runs verify forwards, not prefills")
    if arg("enable_two_batch_overlap", False):
        problems.append("two-batch overlap: a batch reaches the hook in halves")
    if arg("enable_return_aux_hidden_states", False) or arg("return_aux_hidden_state_layer_ids"):
        problems.append("aux hidden states returned to clients: SGLang sets its own capture "
                        "layers, over the plugin's")
    return problems


def captured_layers(model: Any) -> list[int]:
    """The layers whose input the model captures, read back from SGLang's model, in our
    convention (SGLang's `layers_to_capture` holds exactly that)."""
    inner = getattr(model, "language_model", None) or model  # Kimi-K2.5 wraps a DeepSeek-V3
    return list(inner.model.layers_to_capture)


def model_name(model: Any) -> str:
    return type(model).__name__


def switch_capture_on(model: Any, layer_ids: Sequence[int]) -> None:
    """Tell the model which layers to capture, as SGLang's own EAGLE-3 path does for a
    speculative target, and read them back: a mismatch stops the server."""
    names = [c.__name__ for c in type(model).__mro__]
    arch = layers.known_architecture(names)
    if arch is None:
        raise CaptureError(f"eagle3d capture: no known layer-id convention for {names[0]}")
    model.set_eagle3_layers_to_capture(layers.sglang_layer_ids(list(layer_ids), arch))
    check_layers(model, layer_ids)


def check_layers(model: Any, layer_ids: Sequence[int]) -> None:
    captured = captured_layers(model)
    if captured != list(layer_ids):
        raise CaptureError(f"eagle3d capture: {model_name(model)} captures the inputs of layers "
                           f"{captured}, the contract names {list(layer_ids)}")


# ---- the handshake: the daemon's proof that capture is on --------------------------------------

def write_handshake(settings: CaptureSettings, info: dict[str, Any]) -> Path:
    path = settings.spool / HANDSHAKE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**info, "token": settings.token, "contract": settings.contract}))
    os.replace(tmp, path)
    return path


def read_handshake(spool: Path, token: str) -> dict[str, Any] | None:
    """The ready file of the server started with `token`; None while there is none (a file left
    by an earlier start carries another token)."""
    try:
        found = json.loads((Path(spool) / HANDSHAKE_FILE).read_text())
    except (FileNotFoundError, ValueError):  # absent, or caught between write and rename
        return None
    return found if isinstance(found, dict) and found.get("token") == token else None


def failed_writes(spool: Path) -> list[tuple[str, str]]:
    """(sample id, kind) of each dump the plugin reported it could not write, each reported
    once (its marker removed as it is read)."""
    folder = Path(spool) / FAILED_FOLDER
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        sid, _, kind = name.partition(".")
        if dumpformat.SAMPLE_ID.fullmatch(sid) and kind in ("disk_full", "write_failed"):
            found.append((sid, kind))
        (folder / name).unlink(missing_ok=True)
    return found


def handshake_problem(found: dict[str, Any], contract: dict[str, Any], tp: int) -> str | None:
    """Why a ready file does not show the capture the daemon asked for, with the target and
    dtype of the capture contract; None when it does."""
    if found.get("contract") != contract["fingerprint"]:
        return (f"the plugin captures for contract {found.get('contract')}, not "
                f"{contract['fingerprint']}")
    try:
        identity.require(contract, str(found.get("target_fingerprint")),
                         f"{found.get('model_path')} (as SGLang loaded it)")
    except ContractMismatch as exc:
        return str(exc)
    if found.get("dtype") != contract["dtype"]:
        return (f"the server computes in {found.get('dtype')}, the capture contract says "
                f"{contract['dtype']}")
    if found.get("layers") != list(contract["layer_ids"]):
        return (f"the plugin read back capture layers {found.get('layers')}, the contract names "
                f"{list(contract['layer_ids'])}")
    if found.get("tp_size") != tp or found.get("attn_dp_size") != 1:
        return (f"the server runs tp={found.get('tp_size')}, attention-DP "
                f"{found.get('attn_dp_size')}; eagle3d asked for tp={tp} and no attention-DP")
    return None


def prepare(settings: CaptureSettings, model: Any, server_args: Any, tp_rank: int,
            attn_dp_size: int, sglang_version: str) -> Capture | None:
    """What the load-model hook does, given what SGLang tells it: refuse a configuration the
    plugin cannot capture, switch capture on and read it back, and on rank 0 start the writer and
    write the ready file. Raises CaptureError, which stops SGLang's scheduler and so the server."""
    problems = configuration_problems(server_args, attn_dp_size)
    if problems:
        raise CaptureError("eagle3d capture cannot run in this SGLang configuration: "
                           + "; ".join(problems))
    switch_capture_on(model, settings.layer_ids)
    if tp_rank != 0:
        return None  # every rank holds the same full hidden states: rank 0 writes them
    settings.spool.mkdir(parents=True, exist_ok=True)
    writer = DumpWriter(settings.spool, settings.contract, ledger_loss_masks(settings.ledger),
                        settings.request_key)
    capture = Capture(writer, len(settings.layer_ids),
                      radix_cache_off=bool(getattr(server_args, "disable_radix_cache", False)),
                      dump_dtype=settings.dump_dtype)
    # The weights of the path SGLang loaded, read after its load: the daemon refuses a server
    # whose target is not the capture contract's before it sends a request.
    model_path = str(server_args.model_path)
    write_handshake(settings, {
        "pid": os.getpid(), "sglang": sglang_version, "model": model_name(model),
        "model_path": model_path, "target_fingerprint": fingerprint_file_or_folder(model_path),
        "dtype": str(server_args.dtype),
        "layers": captured_layers(model), "tp_size": getattr(server_args, "tp_size", None),
        "pp_size": getattr(server_args, "pp_size", 1), "attn_dp_size": attn_dp_size,
        "attn_cp_size": getattr(server_args, "attn_cp_size", 1)})
    log.info("eagle3d capture: %s, layers %s, dumps to %s", model_name(model),
             list(settings.layer_ids), settings.spool)
    return capture


# ---- the SGLang glue ---------------------------------------------------------------------------
# Run inside SGLang 0.5.17 on an H200 (docs/sglang.md); here only through the functions above.

_capture: Capture | None = None
_settings: CaptureSettings | None = None
_model: Any = None          # the target model, for the re-read of its capture layers
_layers_rechecked = False


def register() -> None:
    """The entry point SGLang's `load_plugins()` (sglang/srt/plugins/__init__.py) calls in each
    of its processes; the hooks take effect in the scheduler processes, which run the model.
    SGLang logs and swallows what fails here: the missing ready file is what makes it loud."""
    global _settings
    _settings = CaptureSettings.from_env(os.environ)
    if _settings is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(LOAD_MODEL_TARGET, _after_load_model, HookType.AFTER)
    HookRegistry.register(LOGITS_TARGET, _before_logits, HookType.BEFORE)


def _after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ModelRunner.load_model (model_executor/model_runner.py); an exception here stops
    the scheduler, so the server does not come up."""
    global _capture, _model
    assert _settings is not None
    if getattr(model_runner, "is_draft_worker", False):
        return
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
    from sglang.srt.layers.dp_attention import get_attention_dp_size
    from importlib import metadata
    _model = model_runner.model
    _capture = prepare(_settings, _model, model_runner.server_args,
                       get_tensor_model_parallel_rank(), get_attention_dp_size(),
                       metadata.version("sglang"))


def _before_logits(processor: Any, *args: Any, **kwargs: Any) -> None:
    """Before LogitsProcessor.forward, which every supported model calls with the post-norm
    hidden states of all the batch's tokens and, once capture is on, its aux hidden states."""
    global _layers_rechecked
    if _capture is None:
        return
    if not _layers_rechecked:
        # Anything after load_model that re-sets the capture layers (SGLang's own aux-state
        # return does) shows here, before the first dump.
        assert _settings is not None
        check_layers(_model, _settings.layer_ids)
        _layers_rechecked = True
    bound = dict(zip(LOGITS_ARGS, args))
    bound.update(kwargs)
    batch = bound.get("logits_metadata")
    rids = getattr(batch, "rids", None)  # a ForwardBatch (model_executor/forward_batch_info.py)
    if rids is None:
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    _capture.on_forward(batch.forward_mode == ForwardMode.EXTEND, rids,
                        batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu, batch.input_ids,
                        bound.get("aux_hidden_states"), bound["hidden_states"])

