"""Megatron's ``jit_fuser`` functions compiled on their first call, and only when compiling is on.

megatron-core 0.16 sets ``megatron.core.jit.jit_fuser = torch.compile`` when it is imported, and
some forty functions (SwiGLU and GeGLU bodies, bias-dropout-add, MoE router helpers) are decorated
with it while megatron-core's modules import. ``torch.compile(fn)`` imports dynamo and Inductor
right away: about 2 s of CPU in every process that imports megatron-core, every rank of every job,
whether or not a compiled function ever runs (`Throughput.torch_compile` is off by default, and the
trainer then runs them eagerly).

`install` puts a finder on ``sys.meta_path`` that lets ``megatron.core.jit`` import as usual and
then replaces its ``jit_fuser`` with `compiled_on_first_call`, before any module decorates with it.
A decorated function then runs as it is written while compiling is off (what
``torch.compiler.set_stance("force_eager")`` did to the compiled one: the same values, the same
saved tensors), and is compiled by ``torch.compile`` at its first call once `set_compiling` has
turned compiling on (`Throughput.torch_compile`, when a model config is built). Where megatron-core
was imported before `install`, its functions are compiled already, and `set_compiling` sets torch's
compile stance too ("force_eager" when off), as it always did. This module imports nothing itself:
torch comes with megatron-core.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

JIT_MODULE = "megatron.core.jit"

_compiling = False


def set_compiling(compile: bool) -> None:
    """Whether megatron's ``jit_fuser`` functions compile (True) or run eagerly (False), process-wide."""
    import torch

    global _compiling
    _compiling = compile
    if compile or "torch._dynamo" in sys.modules:  # functions compiled before `install`, or compiling now
        torch.compiler.set_stance("default" if compile else "force_eager")


def compiled_on_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly while compiling is off, ``torch.compile(fn)`` (made at its first such call) when on."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if not _compiling:
            return fn(*args, **kwargs)
        if compiled is None:
            import torch

            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


class _DeferringLoader(importlib.abc.Loader):
    """The loader of ``megatron.core.jit``, which swaps ``jit_fuser`` once the module has run."""

    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)  # imports torch
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compiled_on_first_call

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ...: tracebacks and coverage
        return getattr(self._inner, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Defer megatron's ``jit_fuser`` compilation (module docstring); a no-op once megatron-core is imported."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
