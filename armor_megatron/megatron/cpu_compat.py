"""Make megatron-core 0.16.1 run on a CPU-only torch build with the gloo backend.

megatron-core assumes CUDA in a handful of places even when every tensor it touches is on
the CPU. `apply()` installs one named work-around per assumption; it is a no-op when CUDA
is available (GPU runs use megatron-core untouched) and idempotent. `dist.initialize()` calls
it for CPU processes; tests and single-process tools may call it directly.

Work-arounds (megatron-core behaviour covered -> what we do):

* `cuda_current_device_on_cpu`: ``torch.cuda.current_device()`` is used as the device of new
  tensors (rotary embedding, TP layers and mappings, p2p shape exchange, MoE router, checkpoint
  saver) -> on a CPU-only build it returns the CPU device.
* `cuda_synchronize_on_cpu`: ``torch.cuda.synchronize()`` in p2p communication and the async
  checkpoint writer -> a no-op (CPU ops are synchronous).
* `cuda_literal_devices_on_cpu`: ``device="cuda"`` literals in the pipeline schedules' token
  counter and in the default / sliding-window causal masks -> those functions run under a
  torch-function mode that places factory calls naming ``cuda`` on the CPU.
* `tied_embedding_sync_on_cpu`: with tied embeddings and PP, ``LanguageModule.
  setup_embeddings_and_output_layer`` moves the last stage's copy of the embedding with
  ``Tensor.cuda()`` before all-reducing it from the first stage -> inside that method
  ``Tensor.cuda()`` leaves CPU tensors where they are.
* `cpu_rng_tracker`: the model-parallel RNG tracker (``model_parallel_cuda_manual_seed``, the
  tracker's ``add``/``fork``) reads and writes CUDA generator states -> a tracker with the same
  semantics on the CPU generator.
* `moe_router_gemm_without_te`: ``RouterGatingLinearFunction`` tests ``te_general_gemm`` which is
  only defined when Transformer Engine imports -> defined as None so the torch path is taken.
* `moe_alltoall_dispatcher_on_cpu`: the alltoall token dispatcher creates a ``torch.cuda.Stream``,
  moves split sizes to the host on it and converts them to numpy only for CUDA tensors (so
  ``all_to_all_single`` gets tensors as split sizes and refuses them) -> a stand-in stream whose
  context and events are no-ops, and the host copy converts CPU tensors to numpy too.
* `mla_without_te`: ``MLASelfAttention`` calls ``isinstance(linear_proj, TELinear)`` with
  a MagicMock ``TELinear`` when Transformer Engine is absent -> a class nothing is an instance of.
* `optimizer_on_cpu`: the (non-distributed) Megatron optimizers create their loss-scale and
  overflow tensors with ``device='cuda'``, the grad-norm / clipping / zero-count helpers their
  work buffers too, and ``clip_grad_by_total_norm_fp32`` and the bf16 optimizer assert
  ``param.type() == 'torch.cuda.FloatTensor'`` (or ``BFloat16Tensor``) -> those functions run
  with CUDA factory literals placed on the CPU, and inside them ``Tensor.type()`` of a CPU
  tensor reports the CUDA type name of its dtype. (The distributed optimizer refuses CPU
  tensors outright; CPU runs use the plain one.)

Version guard: the work-arounds patch internals of the release they were checked against.
Importing `armor_megatron.megatron` refuses another minor release (`mcore_version.check`, on the
installed package's metadata, on GPU runs too); `apply()` runs the same check on
``megatron.core.__version__`` where there is no metadata (a source checkout).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from armor_megatron.megatron import mcore_version

_applied = False


def apply() -> bool:
    """Install every work-around if CUDA is unavailable. Returns True when they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    if mcore_version.installed_version() is None:  # otherwise checked when the subpackage was imported
        import megatron.core

        mcore_version.check(megatron.core.__version__)
    for workaround in WORKAROUNDS:
        workaround()
    _applied = True
    return True


# ----------------------------------------------------------------------------- work-arounds
_MARK = "__armor_cpu_compat__"  # set on every replacement, so that none is applied twice


def _patch(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name``: a torch attribute whose stand-in deliberately differs from its declared type."""
    setattr(owner, name, value)


def _mark(fn: Any) -> Any:
    """``fn``, marked as one of this module's replacements."""
    setattr(fn, _MARK, True)
    return fn


def cuda_current_device_on_cpu() -> None:
    """``torch.cuda.current_device()`` names the device of new tensors throughout megatron-core."""
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))


def cuda_synchronize_on_cpu() -> None:
    """``torch.cuda.synchronize()`` after p2p sends and in the async checkpoint writer."""
    torch.cuda.synchronize = lambda device=None: None


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites a ``device`` argument naming CUDA to the CPU for every torch call inside it."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _run_inside(
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator factory: run the wrapped megatron function inside ``context()``; marks it patched."""

    def make(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with context():
                return fn(*args, **kwargs)

        _mark(wrapper)
        return wrapper

    return make


def _replace(module: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``module.name`` by ``make(old)`` once; a missing name means megatron-core moved."""
    old = getattr(module, name, None)
    if old is None:
        owner = (
            module.__name__ if isinstance(module, types.ModuleType) else f"{module.__module__}.{module.__qualname__}"
        )
        raise RuntimeError(f"cpu_compat: {owner}.{name} not found; megatron-core internals changed")
    if not getattr(old, _MARK, False):
        setattr(module, name, make(old))


def cuda_literal_devices_on_cpu() -> None:
    """``device="cuda"`` literals: schedules' ``total_num_tokens`` and the causal-mask helpers."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        _replace(schedules, name, _run_inside(_CudaFactoriesOnCpu))
    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        _replace(utils, name, _run_inside(_CudaFactoriesOnCpu))
        setattr(fused_softmax, name, getattr(utils, name))


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    _patch(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    try:
        yield
    finally:
        _patch(torch.Tensor, "cuda", original)


def tied_embedding_sync_on_cpu() -> None:
    """``setup_embeddings_and_output_layer`` calls ``weight.data.cuda()`` before its all-reduce."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _replace(LanguageModule, "setup_embeddings_and_output_layer", _run_inside(_tensor_cuda_is_identity))


class CpuRNGStatesTracker:
    """megatron's ``CudaRNGStatesTracker`` semantics on the CPU generator.

    Named streams (data-parallel, model-parallel, expert-parallel) are seeded by ``add`` and
    entered with ``fork``; leaving a fork saves the stream's advanced state and restores the
    caller's state, exactly as the CUDA tracker does for the CUDA generator.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = kwargs.get("is_inference_rng_tracker", False)
        self.reset()

    def is_initialized(self) -> bool:
        """Whether any state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every state and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the named RNG states."""
        return dict(self.states_)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the named RNG states."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Add an RNG state ``name`` seeded with ``seed``; a repeated name or seed raises."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block under RNG state ``name`` (saved back after), restoring the outer state."""
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def cpu_rng_tracker() -> None:
    """``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` use CUDA generators."""
    from megatron.core.tensor_parallel import random

    if not hasattr(random, "_CUDA_RNG_STATE_TRACKER") or not hasattr(random, "CudaRNGStatesTracker"):
        raise RuntimeError("cpu_compat: megatron.core.tensor_parallel.random has no RNG tracker; internals changed")
    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Checkpointed activations restore generator states through these two helpers.
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def moe_router_gemm_without_te() -> None:
    """``RouterGatingLinearFunction`` reads ``te_general_gemm``, defined only when TE imports."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _NoTELinear:
    """A class no module is an instance of: stands in for an absent ``TELinear``."""


def mla_without_te() -> None:
    """Let MLA attention build without Transformer Engine.

    ``MLASelfAttention.__init__`` tests ``isinstance(linear_proj, TELinear)`` behind a
    ``HAVE_TE`` flag that is True whenever megatron's TE extension module imports, even when
    ``TELinear`` is its placeholder (a MagicMock) because Transformer Engine is absent.
    """
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.TELinear = _NoTELinear


class _HostStream:
    """Stands in for ``torch.cuda.Stream`` where megatron-core only orders host copies."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self, event: object = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    __hash__ = object.__hash__


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


_mark(_host_copy)


def moe_alltoall_dispatcher_on_cpu() -> None:
    """The alltoall dispatcher moves split sizes to the host (as numpy) on a ``torch.cuda.Stream``."""
    from megatron.core.transformer.moe import token_dispatcher

    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", lambda old: _host_copy)
    host = _HostStream()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host
    _patch(torch.cuda, "current_stream", lambda device=None: host)
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())


@contextlib.contextmanager
def _cpu_tensors_report_cuda_type() -> Iterator[None]:
    original = torch.Tensor.type
    if getattr(original, _MARK, False):  # nested (a wrapped __init__ calling super's)
        yield
        return

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)  # under a torch-function mode this may be cuda_type again
        if args or kwargs or self.is_cuda or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    _patch(torch.Tensor, "type", _mark(cuda_type))
    try:
        yield
    finally:
        _patch(torch.Tensor, "type", original)


@contextlib.contextmanager
def _optimizer_cuda_assumptions_on_cpu() -> Iterator[None]:
    with _CudaFactoriesOnCpu(), _cpu_tensors_report_cuda_type():
        yield


def optimizer_on_cpu() -> None:
    """``device='cuda'`` buffers and ``'torch.cuda.*Tensor'`` type asserts in the optimizer path."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optim

    wrap = _run_inside(_optimizer_cuda_assumptions_on_cpu)
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        _replace(clip_grads, name, wrap)
        setattr(optim, name, getattr(clip_grads, name))  # optimizer.py imported them by name
    for cls in (optim.MixedPrecisionOptimizer, optim.Float16OptimizerWithFloat16Params, optim.FP32Optimizer):
        if "__init__" in vars(cls):
            _replace(cls, "__init__", wrap)
    _replace(optim.ChainedOptimizer, "get_loss_scale", wrap)


WORKAROUNDS = (
    cuda_current_device_on_cpu,
    cuda_synchronize_on_cpu,
    cuda_literal_devices_on_cpu,
    tied_embedding_sync_on_cpu,
    cpu_rng_tracker,
    moe_router_gemm_without_te,
    moe_alltoall_dispatcher_on_cpu,
    optimizer_on_cpu,
    mla_without_te,
)
