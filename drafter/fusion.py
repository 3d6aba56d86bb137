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


def fused_on_cuda(fn: F | None = None, *,
                  dynamic: bool | None = None) -> F | Callable[[F], F]:
    """`fn`, compiled when its first argument is a CUDA tensor (once per shape family), except
    in inference mode: drafting (evaluation) changes shapes with every accepted chain and has no
    backward to save memory for. The compiler is only imported when first used: CPU processes
    never pay for it. `dynamic=True` compiles for any length from the first call on: for a
    function whose argument lists vary too (one graph per list length), so that lengths times
    list lengths stay within the compiler's 8 graphs per function."""
    if fn is None:
        return functools.partial(fused_on_cuda, dynamic=dynamic)

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args, **kwargs):
        if not x.is_cuda or torch.is_inference_mode_enabled():
            return fn(x, *args, **kwargs)
        if run.compiled is None:
            run.compiled = torch.compile(fn, dynamic=dynamic)
        return run.compiled(x, *args, **kwargs)
    run.compiled = None
    return run  # type: ignore[return-value]
