"""Wrapping and launching tdpipe's Triton kernels in either of triton's modes (model/triton_attention.py,
model/triton_ops.py).

Triton fixes interpreted or compiled mode when it is first imported (TRITON_INTERPRET=1 then: its own library,
tl.zeros, tl.max..., is jitted at import), and `triton.jit` reads the variable when it decorates. So kernel
bodies are plain functions, wrapped on first use by `kernel_set`; they call no other jitted function of ours,
so wrapping them one by one is enough. CUDA tensors run in the mode triton was imported in; CPU tensors always
run interpreted, also when triton was imported for compiling (torch._dynamo imports it whenever a model is
built on the meta device): `launching` then runs triton's library functions interpreted during the launch.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
import triton.runtime  # bound explicitly: `import triton` alone left it unbound in one GPU process


def interpreted() -> bool:
    """Is triton running under its interpreter? Decided when triton is first imported: its own library
    (tl.zeros, tl.max, ...) is jitted then, in the mode TRITON_INTERPRET selects."""
    return not isinstance(tl.zeros, triton.runtime.JITFunction)


def varying(*names: str) -> Callable[[Callable], Callable]:
    """Mark a kernel body's integer arguments that change from step to step (a batch's sequence count, its
    block table's width). Compiled Triton specialises each integer on == 1 and on divisibility by 16, one
    compile per combination (about a second each) met in the middle of a run, where the first requests of a
    server or a benchmark's timed run would wait for it; these arguments are compiled generically instead."""
    def mark(fn: Callable) -> Callable:
        fn.varying = names  # type: ignore[attr-defined]
        return fn
    return mark


def kernel_set(interpret: bool, **bodies: Callable) -> SimpleNamespace:
    """The bodies wrapped for one mode, as attributes of their keyword names (`interpreted` says which)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return SimpleNamespace(interpreted=True, **{name: InterpretedFunction(fn) for name, fn in bodies.items()})
    return SimpleNamespace(interpreted=False, **{
        name: triton.runtime.JITFunction(fn, do_not_specialize=list(getattr(fn, "varying", ())))
        for name, fn in bodies.items()})


def interpret_for(t: torch.Tensor) -> bool:
    """Must kernels on t's device run interpreted? CPU tensors always, CUDA tensors in triton's mode."""
    return t.device.type == "cpu" or interpreted()


@functools.cache
def _interpreted_twin(fn: Callable) -> Callable:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _call_interpreted(self: triton.runtime.JITFunction, *args, **kwargs):
    return _interpreted_twin(self.fn)(*args, **kwargs)


@contextlib.contextmanager
def launching(kern: SimpleNamespace) -> Iterator[None]:
    """Around a launch. Interpreting while triton's own library was jitted for compiling: its functions
    (tl.zeros, tl.max, ...) would raise when called, so during the launch they run interpreted, as they would
    under TRITON_INTERPRET=1."""
    if not kern.interpreted or interpreted():
        yield
        return
    jit_fn = triton.runtime.JITFunction
    saved = jit_fn.__call__  # outside a kernel it only raises, so nothing else depends on it meanwhile
    jit_fn.__call__ = _call_interpreted
    try:
        yield
    finally:
        jit_fn.__call__ = saved


def pow2(n: int) -> int:
    """The power of two at or above n (at least 1): Triton's block sizes."""
    return triton.next_power_of_2(max(int(n), 1))
