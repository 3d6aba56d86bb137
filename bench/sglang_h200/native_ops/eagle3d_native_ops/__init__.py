"""Smoke-only SGLang plugin for a bundle without the kernel libraries' JIT sources: every
MultiPlatformOp (RMSNorm, SiluAndMul, rotary embedding) but the MoE router and experts runs its
pure-torch forward_native, and SGLang's JIT KV-cache store is off (it falls back to indexing).
Without it the first prefill fails: `ninja: error: .../flashinfer/data/csrc/norm.cu missing`.
Never install it next to a production server: it trades speed for running anywhere.
EAGLE3D_NATIVE_OPS=0 turns it off (run.sh's kernels step, with flashinfer's JIT sources
restored).

It also lets a speculative server capture its CUDA graphs with the bundle's trimmed packages
(`graph_backends`), whatever EAGLE3D_NATIVE_OPS says."""

import importlib.abc
import importlib.machinery
import logging
import os
import sys

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


# Before capturing a speculative server's CUDA graphs, SGLang's EAGLE worker imports these
# attention backends only to list their classes among those whose draft-extend step can be
# graphed (eagle_worker_v2._capture_cuda_graphs). They import DeepSeek's sparse-attention stack
# at module level (deep_gemm, the CuTe DSL, einops), which the bundle leaves out: the chain and
# tree servers died there with `No module named 'deep_gemm'` (docs/sglang.md). A Llama server
# never runs them, so a module that cannot be imported gets a class no backend is an instance of.
GRAPH_BACKENDS = {
    "sglang.srt.layers.attention.dsa_backend": "DeepseekSparseAttnBackend",
    "sglang.srt.layers.attention.deepseek_v4_backend": "DeepseekV4AttnBackend",
    "sglang.srt.layers.attention.flashmla_backend": "FlashMLABackend",
}


class _Unused:
    """Stands for an attention backend this bundle cannot import: nothing is an instance of it."""


class _LoaderWithPlaceholder(importlib.abc.Loader):
    """Runs the real module; if an import inside it fails, keeps what ran and adds the class."""

    def __init__(self, real: importlib.abc.Loader, name: str, cls: str):
        self.real, self.name, self.cls = real, name, cls

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        try:
            self.real.exec_module(module)
        except ImportError as exc:
            log.warning("eagle3d_native_ops: %s cannot be imported with this bundle (%s); "
                        "%s stands in for it", self.name, exc, self.cls)
            setattr(module, self.cls, type(self.cls, (_Unused,), {}))


class _GraphBackendsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in GRAPH_BACKENDS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWithPlaceholder(spec.loader, name, GRAPH_BACKENDS[name])
        return spec


def graph_backends() -> None:
    if not any(isinstance(f, _GraphBackendsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GraphBackendsFinder())


def register():
    graph_backends()
    if os.environ.get("EAGLE3D_NATIVE_OPS") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(OPS_TARGET, _native, HookType.REPLACE)
    HookRegistry.register(KV_STORE_TARGET, _no_jit_store, HookType.REPLACE)
    log.warning("eagle3d_native_ops: SGLang's fused ops run in native torch (smoke runs only)")
