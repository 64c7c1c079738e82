"""Distributed start-up and teardown for Megatron workers (torchrun, SLURM, or one process).

Public interface::

    env = DistEnv.from_environ()                 # rank / world / local rank / master address
    par = ParallelConfig(tp=2, pp=2, ep=1, cp=1, vpp=None)
    ctx = initialize(par, arch=None, seed=1234, deterministic=False)   # -> DistContext
    ...
    shutdown()                                    # destroys model-parallel groups and the process group

Where the rank comes from (first match wins):

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM (``srun`` one task per device): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``;
  ``MASTER_ADDR`` defaults to the first host of ``SLURM_JOB_NODELIST`` (compressed lists such
  as ``gpu[01-03,07]`` are expanded here) and ``MASTER_PORT`` to ``20000 + SLURM_JOB_ID % 20000``
  so that two jobs sharing a node do not collide;
* neither: a single process on 127.0.0.1.

Each process binds exactly one device: ``cuda:LOCAL_RANK`` with NCCL when CUDA is available,
otherwise the CPU with gloo, in which case `cpu_compat.apply()` is run before megatron-core is
used. Model-parallel groups are created with megatron-core's ``parallel_state`` in its default
order ``tp-cp-ep-dp-pp``; data parallelism is what is left: ``dp = world / (tp·pp·cp)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import re
from typing import Mapping, Optional

import torch

from armor_megatron.models.arch import ModelArch


# ----------------------------------------------------------------------------- environment
def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list: ``"n[01-03,07],login"`` -> n01 n02 n03 n07 login.

    Zero padding of a range is kept (``[08-10]`` -> 08 09 10); several bracket groups in one
    name expand as a product (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", name)
        choices = [_expand_brackets(p) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    if not hosts or any(not h or "[" in h or "]" in h for h in hosts):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"cannot parse SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"cannot parse SLURM node list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_brackets(group: str) -> list[str]:
    out = []
    for item in group[1:-1].split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cannot parse SLURM node range [{group[1:-1]}]")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"SLURM node range {item!r} runs backwards")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


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
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "DistEnv":
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
                raise ValueError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find the master host")
            default_port = 20000 + _int(env, "SLURM_JOB_ID", 9500) % 20000
            return cls(
                rank=_int(env, "SLURM_PROCID"),
                world_size=_int(env, "SLURM_NTASKS"),
                local_rank=_int(env, "SLURM_LOCALID", 0),
                master_addr=addr,
                master_port=_int(env, "MASTER_PORT", default_port),
                launcher="slurm",
            )._checked()
        return cls(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 29500), "single")

    def _checked(self) -> "DistEnv":
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size} ({self.launcher})")
        if self.local_rank < 0:
            raise ValueError(f"local rank {self.local_rank} is negative ({self.launcher})")
        return self


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    if key not in env:
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


# ----------------------------------------------------------------------------- parallel layout
@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes. ``vpp`` is the number of virtual pipeline chunks per stage (None: off);
    ``etp`` the expert tensor-parallel size (None: same as ``tp``, megatron-core's default)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    etp: Optional[int] = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def validate(self, world_size: int, arch: Optional[ModelArch] = None) -> None:
        """Raise ValueError with one line naming the first size that does not fit."""
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise ValueError(f"vpp={self.vpp} needs pp >= 2 and vpp >= 1")
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ValueError(f"world size {world_size} is not divisible by tp·pp·cp = {self.tp}·{self.pp}·{self.cp} = {model}")
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ValueError(f"world size {world_size} is not divisible by etp·ep·pp = {self.expert_tp}·{self.ep}·{self.pp} = {expert}")
        if arch is not None:
            arch.validate_parallelism(tp=self.tp, pp=self.pp, ep=self.ep)
            chunks = self.pp * (self.vpp or 1)
            if arch.num_layers % chunks:
                raise ValueError(f"num_layers={arch.num_layers} is not divisible by pp·vpp = {chunks}")


# ----------------------------------------------------------------------------- start-up
@dataclasses.dataclass(frozen=True)
class DistContext:
    env: DistEnv
    parallel: ParallelConfig
    device: torch.device
    backend: str

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


def initialize(
    parallel: ParallelConfig = ParallelConfig(),
    arch: Optional[ModelArch] = None,
    *,
    seed: int = 1234,
    deterministic: bool = False,
    environ: Optional[Mapping[str, str]] = None,
    timeout_minutes: int = 30,
) -> DistContext:
    """Start torch.distributed and megatron-core's model-parallel state for this process.

    Validates the layout against the world size (and `arch` when given) before any process
    group is created, so a bad layout fails at once on every rank with the same message.
    Seeds megatron's RNG tracker with `seed` (tensor-parallel ranks get distinct streams).
    """
    from megatron.core import parallel_state, tensor_parallel

    env = DistEnv.from_environ(environ)
    parallel.validate(env.world_size, arch)
    if torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {env.local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        device, backend = torch.device("cuda", env.local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        from armor_megatron.megatron import cpu_compat

        cpu_compat.apply()
    if deterministic:
        set_deterministic()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
        )
    elif torch.distributed.get_world_size() != env.world_size:
        raise RuntimeError(f"process group already started with world size {torch.distributed.get_world_size()}, environment says {env.world_size}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return DistContext(env=env, parallel=parallel, device=device, backend=backend)


def set_deterministic() -> None:
    """Bit-reproducible kernels: deterministic algorithms, no cuDNN autotuning, fixed cuBLAS workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
