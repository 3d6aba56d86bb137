"""Elementwise work compiled into fused kernels on CUDA, run eagerly on CPU.

On a GPU the drafter's norms, rotations, activations and loss are memory-bound: eagerly each is
several kernels with float32 temporaries, and autograd keeps those temporaries for the backward.
Compiled, each is one or two kernels and the backward recomputes what it needs from the inputs.
Only these small functions are compiled, never one that multiplies by a weight: inside a
compiled graph autocast would cast the float32 weights to bf16 again at every TTT step and keep
every copy for the backward, where eager autocast casts each weight once per training step.
On CPU (the demo, the tests) compiling would cost more than it saves.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiled_for_any_sizes(fn: F, backend: str | Callable = "inductor") -> F:
    """`fn` compiled for any batch rows and lengths from its first call, its features' sizes
    fixed. Training batches change their rows and lengths at every step: a graph compiled for
    the first batch's sizes (tens of seconds on an H200) would be replaced at the second. The
    features (the last dimension of each tensor argument of two or more dimensions: hidden
    size, head size, draft vocabulary) never change, and a reduction over a size known when
    compiling runs faster: compiled with every size unknown, the Kimi-K2.5-sized draft trained
    6.5% slower. Sizes equal in the first call are not taken to be equal ever after ("duck"
    sizing): a batch of 2 rows beside 2 key heads would otherwise compile once more when the
    rows change. Sizes 0 and 1 stay special (a batch of one row compiles its own graph)."""
    import torch.fx.experimental._config as shapes
    shapes.use_duck_shape = False
    compiled = torch.compile(fn, dynamic=True, backend=backend)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.mark_static(a, a.dim() - 1)
        return compiled(*args, **kwargs)
    return run  # type: ignore[return-value]


def fused_on_cuda(fn: F) -> F:
    """`fn`, compiled (compiled_for_any_sizes) when its first argument is a CUDA tensor, except
    in inference mode: drafting (evaluation) changes shapes with every accepted chain and has no
    backward to save memory for. The compiler is only imported when first used: CPU processes
    never pay for it."""

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args, **kwargs):
        if not x.is_cuda or torch.is_inference_mode_enabled():
            return fn(x, *args, **kwargs)
        if run.compiled is None:
            run.compiled = compiled_for_any_sizes(fn)
        return run.compiled(x, *args, **kwargs)
    run.compiled = None
    return run  # type: ignore[return-value]
