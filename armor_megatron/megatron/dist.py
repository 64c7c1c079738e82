"""Distributed start-up and teardown for Megatron workers (torchrun, SLURM, or one process).

Public interface::

    env = DistEnv.from_environ()                 # rank / world / local rank / master address
    par = ParallelConfig(tp=2, pp=2, ep=1, cp=1, vpp=None)
    ctx = initialize(par, arch=None, seed=1234, deterministic=False)   # -> DistContext
    set_model_parallel(other_par, arch=None, seed=1234)   # switch layout in a running job
    ...
    shutdown()                                    # destroys model-parallel groups and the process group

Where the rank comes from (first match wins):

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM (``srun`` one task per device): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``;
  ``MASTER_ADDR`` defaults to the first host of ``SLURM_JOB_NODELIST`` (compressed lists such
  as ``gpu[01-03,07]`` are expanded here) and ``MASTER_PORT`` to ``20000 + SLURM_JOB_ID % 20000``
  so that two jobs sharing a node do not collide;
* neither: a single process on 127.0.0.1, rendezvousing with itself on a port the OS picks
  (``MASTER_PORT`` when set).

Each process binds exactly one device: ``cuda:LOCAL_RANK`` when CUDA is available (default group
``cpu:gloo,cuda:nccl``: NCCL for device tensors, gloo for host ones), otherwise the CPU with
gloo, in which case `cpu_compat.apply()` is run before megatron-core is
used. Model-parallel groups are created with megatron-core's ``parallel_state`` in its default
order ``tp-cp-ep-dp-pp``; data parallelism is what is left: ``dp = world / (tp·pp·cp)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch

from armor_megatron.errors import UserInputError
from armor_megatron.launch.nodelist import expand_nodelist
from armor_megatron.models.arch import ModelArch


# ----------------------------------------------------------------------------- environment
@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job; read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Rank, world size and rendezvous from a launcher's environment (torchrun or SLURM), else a single process."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                rank=_int(env, "RANK"),
                world_size=_int(env, "WORLD_SIZE"),
                local_rank=_int(env, "LOCAL_RANK", 0),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(env, "MASTER_PORT", 29500),
                launcher="torchrun",
            )._checked()
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if "MASTER_ADDR" in env:
                addr = env["MASTER_ADDR"]
            elif nodelist:
                addr = expand_nodelist(nodelist)[0]
            else:
                raise UserInputError(
                    "SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find the master host"
                )
            default_port = 20000 + _int(env, "SLURM_JOB_ID", 9500) % 20000
            return cls(
                rank=_int(env, "SLURM_PROCID"),
                world_size=_int(env, "SLURM_NTASKS"),
                local_rank=_int(env, "SLURM_LOCALID", 0),
                master_addr=addr,
                master_port=_int(env, "MASTER_PORT", default_port),
                launcher="slurm",
            )._checked()
        # a single process rendezvouses with itself: port 0 lets the OS pick a free one (two single-process
        # runs on one machine, e.g. tiny CPU jobs side by side, never collide)
        return cls(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 0), "single")

    def _checked(self) -> DistEnv:
        if not 0 <= self.rank < self.world_size:
            raise UserInputError(f"rank {self.rank} is outside world size {self.world_size} ({self.launcher})")
        if self.local_rank < 0:
            raise UserInputError(f"local rank {self.local_rank} is negative ({self.launcher})")
        return self


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    if key not in env:
        if default is None:
            raise UserInputError(f"environment variable {key} is not set")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise UserInputError(f"environment variable {key}={env[key]!r} is not an integer") from None


# ----------------------------------------------------------------------------- parallel layout
@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes.

    ``vpp`` is the number of virtual pipeline chunks per stage (None: off); ``etp`` the expert
    tensor-parallel size (None: same as ``tp``, megatron-core's default); ``sp`` sequence
    parallelism (not a size: it splits activations along the sequence over TP).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: int | None = None
    etp: int | None = None
    sp: bool | None = None  # sequence parallelism; None: on exactly when Transformer Engine is used and tp > 1

    @classmethod
    def from_run_config(cls, section: Any) -> ParallelConfig:
        """The layout of a run config's ``parallelism`` section (its fields carry these names)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)})

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size (the tensor-parallel size unless set)."""
        return self.tp if self.etp is None else self.etp

    def megatron_sizes(self) -> dict[str, Any]:
        """The sizes under the names shared by ``initialize_model_parallel`` and ``TransformerConfig``."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size of ``world_size`` ranks: world / (tp · pp · cp)."""
        return world_size // (self.tp * self.pp * self.cp)

    def validate(self, world_size: int, arch: ModelArch | None = None) -> None:
        """Raise ValueError with one line naming the first size that does not fit."""
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise ValueError(f"vpp={self.vpp} needs pp >= 2 and vpp >= 1")
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by tp·pp·cp = {self.tp}·{self.pp}·{self.cp} = {model}"
            )
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(
                f"world size {world_size} is not divisible by etp·ep·pp = {self.expert_tp}·{self.ep}·{self.pp} = {expert}"
            )
        if arch is not None:
            arch.validate_parallelism(tp=self.tp, pp=self.pp, ep=self.ep)
            chunks = self.pp * (self.vpp or 1)
            if arch.num_layers % chunks:
                raise ValueError(f"num_layers={arch.num_layers} is not divisible by pp·vpp = {chunks}")


# ----------------------------------------------------------------------------- start-up
@dataclasses.dataclass(frozen=True)
class DistContext:
    """What :func:`initialize` set up: launcher environment, parallel layout, device and backend."""

    env: DistEnv
    parallel: ParallelConfig
    device: torch.device
    backend: str


def initialize(
    parallel: ParallelConfig = ParallelConfig(),
    arch: ModelArch | None = None,
    *,
    seed: int = 1234,
    deterministic: bool = False,
    environ: Mapping[str, str] | None = None,
    timeout_minutes: int = 30,
) -> DistContext:
    """Start torch.distributed and megatron-core's model-parallel state for this process.

    Validates the layout against the world size (and `arch` when given) before any process
    group is created, so a bad layout fails at once on every rank with the same message.
    Seeds megatron's RNG tracker with `seed` (tensor-parallel ranks get distinct streams).
    """
    env = DistEnv.from_environ(environ)
    parallel.validate(env.world_size, arch)
    on_cuda = torch.cuda.is_available()
    backend = process_group_backend(on_cuda)
    if on_cuda:
        device = torch.device("cuda", _gpu_index(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        from armor_megatron.megatron import cpu_compat

        cpu_compat.apply()
    if deterministic:
        set_deterministic()
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if env.master_port == 0:  # a single process: its own store on a port the OS picks, held by the group
            rendezvous: dict[str, Any] = dict(
                store=torch.distributed.TCPStore(env.master_addr, 0, 1, is_master=True, timeout=timeout)
            )
        else:
            rendezvous = dict(init_method=f"tcp://{env.master_addr}:{env.master_port}")
        torch.distributed.init_process_group(
            backend=backend,
            **rendezvous,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    elif torch.distributed.get_world_size() != env.world_size:
        raise RuntimeError(
            f"process group already started with world size {torch.distributed.get_world_size()}, environment says {env.world_size}"
        )
    set_model_parallel(parallel, arch, seed=seed, timeout_minutes=timeout_minutes)
    return DistContext(env=env, parallel=parallel, device=device, backend=backend)


CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # NCCL for device tensors, gloo for host ones (flags, objects)


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def is_distributed() -> bool:
    """Whether the default process group holds more than this process."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def process_group_backend(on_cuda: bool) -> str:
    """The default group's backend.

    On GPUs it gets both: NCCL carries CUDA tensors, gloo the host tensors a trainer reduces between
    steps (a preemption flag, small metrics); a NCCL-only group fails those with "No backend type
    associated with device type cpu".
    """
    return CUDA_BACKEND if on_cuda else "gloo"


def _gpu_index(local_rank: int, visible: int) -> int:
    """GPU of this process.

    ``cuda:LOCAL_RANK``, or the only visible one when the launcher already bound one GPU per task
    (``srun --gpus-per-task=1`` sets CUDA_VISIBLE_DEVICES).
    """
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise UserInputError(f"local rank {local_rank} has no GPU ({visible} visible)")


def set_model_parallel(
    parallel: ParallelConfig, arch: ModelArch | None = None, *, seed: int = 1234, timeout_minutes: int = 30
) -> None:
    """(Re)build megatron-core's model-parallel groups for `parallel` on the running process group.

    Any previous layout is destroyed first, so one job can switch layouts (tests comparing
    TP/PP/EP against TP=1, single-process tools). Seeds the RNG tracker as `initialize` does.
    """
    from megatron.core import parallel_state, tensor_parallel

    parallel.validate(torch.distributed.get_world_size(), arch)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**parallel.megatron_sizes(), distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def set_deterministic() -> None:
    """Bit-reproducible kernels.

    Deterministic algorithms, no cuDNN autotuning, fixed cuBLAS workspace, Transformer Engine's
    deterministic attention (megatron's ``deterministic_mode``, which the model builder turns on
    with these on a GPU, refuses TE attention without it).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def shutdown() -> None:
    """Destroy megatron-core's model-parallel groups and the default process group (idempotent)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
