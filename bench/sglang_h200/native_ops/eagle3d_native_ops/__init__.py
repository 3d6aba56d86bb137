"""Smoke-only SGLang plugin for a bundle without the kernel libraries' JIT sources: every
MultiPlatformOp (RMSNorm, SiluAndMul, rotary embedding) but the MoE router and experts runs its
pure-torch forward_native, and SGLang's JIT KV-cache store is off (it falls back to indexing).
Without it the first prefill fails: `ninja: error: .../flashinfer/data/csrc/norm.cu missing`.
Never install it next to a production server: it trades speed for running anywhere.
EAGLE3D_NATIVE_OPS=0 turns it off (run.sh's kernels step, with flashinfer's JIT sources
restored)."""

import logging
import os

log = logging.getLogger("eagle3d_native_ops")

OPS_TARGET = "sglang.srt.layers.utils.multi_platform.MultiPlatformOp.dispatch_forward"
KV_STORE_TARGET = "sglang.kernels.ops.kvcache.kvcache.can_use_store_cache"


# SGLang's mixture-of-experts router and experts keep their CUDA paths (sgl_kernel's top-k and
# the Triton fused MoE, which the bundle has): the experts' native path (moe_forward_native, its
# forward_cpu) never applies DeepSeek-V3's routed scaling factor (docs/sglang.md, "Found on the
# H200").
KEEP_CUDA = ("TopK", "UnquantizedFusedMoEMethod")


def _native(op):
    return op.forward_cuda if type(op).__name__ in KEEP_CUDA else op.forward_native


def _no_jit_store(*args, **kwargs):
    return False


def register():
    if os.environ.get("EAGLE3D_NATIVE_OPS") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(OPS_TARGET, _native, HookType.REPLACE)
    HookRegistry.register(KV_STORE_TARGET, _no_jit_store, HookType.REPLACE)
    log.warning("eagle3d_native_ops: SGLang's fused ops run in native torch (smoke runs only)")
