"""Turn a run config and a SLURM allocation into the exact commands of the job.

    plan = plan_job(cfg, SlurmEnv.from_environ(os.environ), train_args=["--config", path])
    plan.engines[i].command    # srun ... python -m sglang.launch_server ... (started first, in background)
    plan.trainer_command       # srun ... python -m armor_megatron.cli.train ... (one task per GPU)

Layout of the allocation (``N`` nodes of ``g`` GPUs, ``E = launch.engine_gpus``):

* no launched engines (``rollout.engine: local``, or ``rollout.sglang.urls`` given): the trainer
  takes every GPU; on a CPU job (``g = 0``) it runs tp·pp processes, one data-parallel replica.
* ``colocated``: the trainer takes every GPU and the engines share them; engine ``i`` uses GPUs
  ``[i·t, (i+1)·t)`` counted across nodes (``t = tp_per_engine``, which must divide ``g``).
* ``disaggregated``: ``E = num_engines · t`` GPUs are the engines' alone. When ``g`` divides ``E``
  the last ``E/g`` nodes are engine nodes (dedicated); otherwise, when ``N`` divides ``E``,
  every node keeps its last ``E/N`` GPUs for engines and gives the first ``g − E/N`` to the trainer.

The engines are the policy group (``rollout.sglang.num_engines``) followed, when anchors come
from a separate frozen reference (``anchor.source: separate`` without ``anchor.reference_urls``),
by the reference group (``anchor.reference_engines``, same ``tp_per_engine``); every count above
is over both groups. Engines run ``rollout.sglang.python`` (the SGLang environment's interpreter;
the trainer's, ``ARMOR_PYTHON``, when null) under ``env -u SGLANG_RETURN_ORIGINAL_LOGPROB``, so an
exported one cannot turn their log-probs into temperature-1 values; colocated, with
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` (``/health`` must not generate while their
memory is released). Engine ``i`` listens on
``base_port + i``; the trainer attaches to them through the ``rollout.sglang.urls`` and
``anchor.reference_urls`` overrides appended to its arguments. The rendezvous port is ``20000 + job_id mod 10000``, moved past the
engine ports if it lands among them. Nothing here runs a command or imports megatron.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Literal, cast

from armor_megatron.config.schema import API_KEY_ENV, RunConfig, lora_peft_modules
from armor_megatron.config.validate import launched_reference_engines
from armor_megatron.errors import UserInputError
from armor_megatron.launch.slurm_env import SlurmEnv

Launcher = Literal["srun", "torchrun"]
LAUNCHERS = ("srun", "torchrun")
DEFAULT_TRAIN_ENTRY = ("python", "-m", "armor_megatron.cli.train")
ALL_INTERFACES = ("0.0.0.0", "::")
ENGINE_KEY_WRAPPER = "armor_megatron.rollout.sglang.launcher"  # a module name, not an import (layering)
# Removed from the engine steps' environment (srun hands them the job's): SGLang would report
# temperature-1 log-probs while the trainer computes them at the sampling temperature.
ENGINE_UNSET_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)
# Set for colocated engines: SGLang 0.5.23's /health generates a token unless this is off
# (sglang/srt/entrypoints/http_server.py, health_generate), and a generation while the engine's
# memory is released kills it. slime starts its engines the same way (slime/ray/rollout.py,
# "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false").
QUIET_HEALTH_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
# Signals torchrun forwards to its workers; SIGUSR1 is SLURM's "time is nearly up" (sbatch --signal).
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

# Exported to every step unless the user's environment already sets them.
DEFAULT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron-core: ordered kernels for TP/SP communication overlap
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a dead rank aborts the collective instead of hanging
    "PYTHONUNBUFFERED": "1",  # log lines reach the SLURM output file as they happen
}


class LaunchPlanError(UserInputError):
    """The run config and the allocation do not make a job; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond the run config; the batch script passes these as ARMOR_* variables."""

    launcher: Launcher = "srun"
    python: str = "python"
    train_entry: tuple[str, ...] = DEFAULT_TRAIN_ENTRY
    srun_args: tuple[str, ...] = ()  # site-specific flags added to every srun, e.g. --mpi=pmix
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: str | None = None
    signal_grace_s: int = 120  # sbatch --signal=B:USR1@<this>; torchrun's worker shutdown timeout
    # CPU cores per GPU for --cpus-per-task (a task gets this many per GPU it drives); without it
    # srun gives each task one core, which starves data loading, reward workers and the engines
    cpus_per_gpu: int | None = None

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise LaunchPlanError(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if not self.train_entry:
            raise LaunchPlanError(
                "ARMOR_TRAIN_ENTRY is empty: give the trainer command, e.g. 'python -m armor_megatron.cli.train'"
            )
        if self.signal_grace_s < 1:
            raise LaunchPlanError(f"signal grace {self.signal_grace_s}s must be >= 1")
        if self.cpus_per_gpu is not None and self.cpus_per_gpu < 1:
            raise LaunchPlanError(f"cpus per GPU {self.cpus_per_gpu} must be >= 1")

    @classmethod
    def from_environ(cls, env: Mapping[str, str], launcher: str | None = None) -> LaunchOptions:
        """Options from ``ARMOR_*`` environment variables; a malformed one raises LaunchPlanError."""
        grace = env.get("ARMOR_SIGNAL_GRACE", "120")
        if not grace.isdigit():
            raise LaunchPlanError(f"ARMOR_SIGNAL_GRACE={grace!r} is not a number of seconds")
        python = env.get("ARMOR_PYTHON") or "python"
        entry = env.get("ARMOR_TRAIN_ENTRY")
        return cls(
            launcher=cast(Launcher, launcher or env.get("ARMOR_LAUNCHER") or "srun"),  # checked in __post_init__
            python=python,
            train_entry=tuple(shlex.split(entry)) if entry is not None else (python, *DEFAULT_TRAIN_ENTRY[1:]),
            srun_args=tuple(shlex.split(env.get("ARMOR_SRUN_ARGS", ""))),
            container_image=env.get("ARMOR_CONTAINER_IMAGE") or None,
            container_mounts=env.get("ARMOR_CONTAINER_MOUNTS") or None,
            signal_grace_s=int(grace),
            cpus_per_gpu=_cpus_per_gpu(env),
        )


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """One SGLang server of ``group`` (policy or reference): ``gpus`` are local GPU indices on ``node``."""

    index: int
    group: Literal["policy", "reference"]
    node: str
    gpus: tuple[int, ...]
    port: int
    url: str
    command: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The commands and addresses of one SLURM job: trainer ranks and engines on its nodes."""

    run_name: str
    job_id: str
    launcher: Launcher
    nodes: tuple[str, ...]
    trainer_nodes: tuple[str, ...]
    trainer_procs_per_node: int
    master_addr: str
    master_port: int
    requeue_exit_code: int
    env: dict[str, str]
    engines: tuple[EngineStep, ...]
    trainer_command: tuple[str, ...]
    engine_api_key: str | None = None

    @property
    def world_size(self) -> int:
        """The number of trainer ranks."""
        return len(self.trainer_nodes) * self.trainer_procs_per_node

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The URLs of every engine."""
        return tuple(e.url for e in self.engines)

    def group_urls(self, group: str) -> list[str]:
        """The URLs of the engines of ``group``."""
        return [e.url for e in self.engines if e.group == group]


@dataclasses.dataclass(frozen=True)
class _Layout:
    trainer_nodes: tuple[str, ...]
    trainer_procs_per_node: int
    engine_slots: tuple[tuple[str, int], ...]  # (node, first GPU) of each engine


def plan_job(
    cfg: RunConfig,
    env: SlurmEnv | Mapping[str, str],
    *,
    train_args: Sequence[str],
    options: LaunchOptions | None = None,
) -> JobPlan:
    """The commands of the job; ``train_args`` are the trainer's own arguments (``--config FILE`` + overrides)."""
    slurm = env if isinstance(env, SlurmEnv) else SlurmEnv.from_environ(env)
    opts = options or (LaunchOptions() if isinstance(env, SlurmEnv) else LaunchOptions.from_environ(env))
    _check_allocation(cfg, slurm)
    layout = _layout(cfg, slurm.nodes)
    sg = cfg.rollout.sglang
    ports = [sg.base_port + i for i in range(len(layout.engine_slots))]
    if ports and ports[-1] > 65535:
        raise LaunchPlanError(f"rollout.sglang.base_port={sg.base_port}: {len(ports)} engine ports run past 65535")
    if len(slurm.nodes) > 1 and ports and sg.host not in ALL_INTERFACES:
        raise LaunchPlanError(
            f"rollout.sglang.host={sg.host}: in a multi-node job the engines must listen on all interfaces "
            "so trainer ranks on other nodes reach them; set rollout.sglang.host=0.0.0.0 (and rollout.sglang.api_key)"
        )
    groups: list[Literal["policy", "reference"]] = [
        "policy" if i < sg.num_engines else "reference" for i in range(len(layout.engine_slots))
    ]
    engines = tuple(
        _engine_step(cfg, opts, i, group, node, first_gpu, port)
        for i, (group, (node, first_gpu), port) in enumerate(zip(groups, layout.engine_slots, ports))
    )
    master_addr = layout.trainer_nodes[0]
    _check_weight_sync(cfg, engines, driver_node=master_addr)
    master_port = _master_port(int(slurm.job_id), set(ports))
    args = without_secrets(train_args)
    for key, group in (("rollout.sglang.urls", "policy"), ("anchor.reference_urls", "reference")):
        urls = [e.url for e in engines if e.group == group]
        if urls:
            args.append(f"{key}=" + json.dumps(urls, separators=(",", ":")))
    shares = any(e.node in layout.trainer_nodes for e in engines)
    trainer = _trainer_command(opts, layout, master_addr, master_port, slurm.job_id, args, overlap=shares)
    return JobPlan(
        run_name=cfg.name,
        job_id=slurm.job_id,
        launcher=opts.launcher,
        nodes=slurm.nodes,
        trainer_nodes=layout.trainer_nodes,
        trainer_procs_per_node=layout.trainer_procs_per_node,
        master_addr=master_addr,
        master_port=master_port,
        requeue_exit_code=cfg.launch.requeue_exit_code,
        env=_job_env(cfg),
        engines=engines,
        trainer_command=trainer,
        engine_api_key=sg.api_key,
    )


SECRET_OVERRIDES = ("rollout.sglang.api_key",)  # reach the trainer as API_KEY_ENV, never on its command line


def without_secrets(train_args: Sequence[str]) -> list[str]:
    """The trainer's arguments without secret overrides (``ps`` on every node shows a command line).

    An override of a secret key is dropped: the plan exports the key as ``API_KEY_ENV``, which the
    trainer reads. A secret inside an override of an enclosing section (``rollout.sglang={api_key:
    ...}``) cannot be taken apart safely and is refused.
    """
    args = []
    for arg in train_args:
        key, eq, value = arg.partition("=")
        if eq and key in SECRET_OVERRIDES:
            continue
        for secret in SECRET_OVERRIDES:
            if eq and secret.startswith(key + ".") and secret.rsplit(".", 1)[-1] in value:
                raise LaunchPlanError(
                    f"{key}=...: a command-line value holding {secret} would show in the trainer's command line; "
                    f"give {secret} as its own override, in the config file or as ${API_KEY_ENV}"
                )
        args.append(arg)
    return args


def _job_env(cfg: RunConfig) -> dict[str, str]:
    """DEFAULT_ENV, plus the fabric's interface for NCCL and gloo (``launch.network_interface``)."""
    env = dict(DEFAULT_ENV)
    if cfg.launch.network_interface:
        env.update(NCCL_SOCKET_IFNAME=cfg.launch.network_interface, GLOO_SOCKET_IFNAME=cfg.launch.network_interface)
    return env


def _check_allocation(cfg: RunConfig, slurm: SlurmEnv) -> None:
    launch = cfg.launch
    if len(slurm.nodes) != launch.nodes:
        raise LaunchPlanError(
            f"launch.nodes={launch.nodes} but the allocation holds {len(slurm.nodes)} node(s) ({' '.join(slurm.nodes)}); "
            "submit with `python -m armor_megatron.cli.slurm submit` so sbatch asks for the config's resources"
        )
    if len(set(slurm.nodes)) != len(slurm.nodes):
        raise LaunchPlanError(f"the node list repeats a host: {' '.join(slurm.nodes)}")
    if slurm.gpus_per_node is not None and slurm.gpus_per_node != launch.gpus_per_node:
        raise LaunchPlanError(
            f"launch.gpus_per_node={launch.gpus_per_node} but SLURM gives {slurm.gpus_per_node} GPU(s) per node"
        )


def _layout(cfg: RunConfig, nodes: tuple[str, ...]) -> _Layout:
    launch, sg, par = cfg.launch, cfg.rollout.sglang, cfg.parallelism
    gpn = launch.gpus_per_node
    launches_engines = cfg.rollout.engine == "sglang" and not sg.urls
    if not launches_engines:
        if launch.engine_gpus:
            why = (
                "rollout.engine is 'local'"
                if cfg.rollout.engine == "local"
                else "rollout.sglang.urls attaches to running servers"
            )
            raise LaunchPlanError(
                f"launch.engine_gpus={launch.engine_gpus} reserves GPUs for engines, but none are launched ({why})"
            )
        if gpn:
            return _Layout(nodes, gpn, ())
        model_parallel = par.tp * par.pp
        if model_parallel % len(nodes):
            raise LaunchPlanError(
                f"CPU job: tp·pp={model_parallel} processes do not spread evenly over {len(nodes)} nodes"
            )
        return _Layout(nodes, model_parallel // len(nodes), ())

    # load_config has checked the engine arithmetic (GPUs per node, tp_per_engine dividing them,
    # engines x tp fitting the job or launch.engine_gpus): see config.validate._check_engines.
    t, n = sg.tp_per_engine, sg.num_engines + launched_reference_engines(cfg)
    if sg.placement == "colocated":
        slots = tuple((nodes[(i * t) // gpn], (i * t) % gpn) for i in range(n))
        return _Layout(nodes, gpn, slots)

    e = launch.engine_gpus
    if e % gpn == 0:
        engine_nodes = nodes[len(nodes) - e // gpn :]
        slots = tuple((engine_nodes[(i * t) // gpn], (i * t) % gpn) for i in range(n))
        return _Layout(nodes[: len(nodes) - e // gpn], gpn, slots)
    if e % len(nodes) == 0 and (e // len(nodes)) % t == 0:
        per_node = e // len(nodes)
        per_node_engines = per_node // t
        slots = tuple((nodes[i // per_node_engines], gpn - per_node + (i % per_node_engines) * t) for i in range(n))
        return _Layout(nodes, gpn - per_node, slots)
    raise LaunchPlanError(
        f"launch.engine_gpus={e} fits neither whole nodes of {gpn} GPUs nor an equal share of each of the "
        f"{len(nodes)} nodes in whole engines of tp {t}"
    )


def _check_weight_sync(cfg: RunConfig, engines: Sequence[EngineStep], driver_node: str) -> None:
    """The weight-sync mode must reach every engine from the driver (global rank 0)."""
    sg = cfg.rollout.sglang
    if sg.weight_sync == "tensor":
        away = next((e for e in engines if e.node != driver_node), None)
        if away is not None:
            raise LaunchPlanError(
                f"rollout.sglang.weight_sync=tensor sends CUDA IPC handles, which only engines on the driver's node "
                f"{driver_node} can open, but engine {away.index} runs on {away.node}: use weight_sync disk "
                "(engines load from a shared file system) or, with disaggregated engines, distributed"
            )


def lora_server_args(rank: int, target_modules: Sequence[str]) -> list[str]:
    """The flags that let SGLang 0.5.23 load adapters of rank <= ``rank`` on ``target_modules`` (PEFT names) at run time.

    Without ``--lora-paths`` SGLang needs both ``--max-lora-rank`` and ``--lora-target-modules``
    (``check_lora_server_args``); its ``--max-loras-per-batch`` (8, base requests included) is left
    as it is: a step holds at most two adapters, the new one and, until it is unloaded, the previous.
    """
    if rank < 1 or not target_modules:
        raise ValueError(f"LoRA serving needs a rank >= 1 and target modules, got {rank} and {list(target_modules)}")
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *target_modules]


def _engine_step(
    cfg: RunConfig,
    opts: LaunchOptions,
    index: int,
    group: Literal["policy", "reference"],
    node: str,
    first_gpu: int,
    port: int,
) -> EngineStep:
    sg = cfg.rollout.sglang
    gpus = tuple(range(first_gpu, first_gpu + sg.tp_per_engine))
    url_host = node if sg.host in ALL_INTERFACES else sg.host
    # With an API key the server starts through the wrapper that reads it from $ARMOR_ENGINE_API_KEY
    # (exported by the batch script), so no command line that `ps` shows carries it.
    entry = [ENGINE_KEY_WRAPPER, "sglang.launch_server"] if sg.api_key else ["sglang.launch_server"]
    server = [
        "env",
        *(arg for name in ENGINE_UNSET_ENV for arg in ("-u", name)),
        *(f"{k}={v}" for k, v in QUIET_HEALTH_ENV.items() if sg.placement == "colocated"),
        sg.python or opts.python,  # the SGLang environment's interpreter
        "-m",
        *entry,
        "--model-path",
        cfg.model.path,
        "--tp-size",
        str(sg.tp_per_engine),
        "--base-gpu-id",
        str(first_gpu),
        "--host",
        sg.host,
        "--port",
        str(port),
        "--mem-fraction-static",
        str(sg.mem_fraction_static),
        "--dtype",
        cfg.model.dtype,
        "--random-seed",
        str(cfg.rollout.seed + index),
    ]
    if sg.placement == "colocated":
        server.append("--enable-memory-saver")  # release/resume_memory_occupation around training
    if sg.deterministic:  # sampling_seed honoured, batch-invariant kernels (SGLangEngine sends per-sample seeds)
        server.append("--enable-deterministic-inference")
    if group == "policy" and cfg.lora.enabled and cfg.lora.sync == "adapter":  # the trainer loads A and B each step
        server += lora_server_args(cfg.lora.rank, lora_peft_modules(cfg.lora.target_modules))
    # --overlap: engine steps share nodes with each other and, colocated, with the trainer step.
    srun = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}"]
    srun += _cpus_per_task(opts, sg.tp_per_engine) + _srun_common(opts)
    url = f"http://{'[' + url_host + ']' if ':' in url_host else url_host}:{port}"
    return EngineStep(index, group, node, gpus, port, url, tuple(srun + server))


def _trainer_command(
    opts: LaunchOptions,
    layout: _Layout,
    master_addr: str,
    master_port: int,
    job_id: str,
    args: list[str],
    *,
    overlap: bool,
) -> tuple[str, ...]:
    nodes = layout.trainer_nodes
    per_node = layout.trainer_procs_per_node
    tasks_per_node = per_node if opts.launcher == "srun" else 1
    srun = [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes) * tasks_per_node}",
        f"--ntasks-per-node={tasks_per_node}",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=1",
    ]
    if overlap:
        srun.append("--overlap")
    srun += _cpus_per_task(opts, 1 if opts.launcher == "srun" else per_node) + _srun_common(opts)
    if opts.launcher == "srun":
        return tuple(srun + list(opts.train_entry) + args)
    entry = list(opts.train_entry)
    if os.path.basename(entry[0]).startswith("python"):
        entry = entry[1:]  # torchrun starts the python interpreter itself
    else:
        entry = ["--no-python", *entry]
    torchrun = [
        "torchrun",
        f"--nnodes={len(nodes)}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={master_addr}:{master_port}",
        f"--rdzv-id={job_id}",
        f"--signals-to-handle={TORCHRUN_SIGNALS}",
        f"--shutdown-timeout={opts.signal_grace_s}",
    ]
    return tuple(srun + torchrun + entry + args)


def _cpus_per_gpu(env: Mapping[str, str]) -> int | None:
    """CPU cores per GPU for srun, or None for srun's default.

    ``ARMOR_CPUS_PER_GPU``, else the allocation's cores per GPU (``SLURM_CPUS_ON_NODE`` over
    ``SLURM_GPUS_ON_NODE``), else None (srun's default).
    """
    explicit = env.get("ARMOR_CPUS_PER_GPU")
    if explicit is not None:
        if not explicit.isdigit():
            raise LaunchPlanError(f"ARMOR_CPUS_PER_GPU={explicit!r} is not a number of cores")
        return int(explicit)
    cpus, gpus = env.get("SLURM_CPUS_ON_NODE", ""), env.get("SLURM_GPUS_ON_NODE", "")
    if cpus.isdigit() and gpus.isdigit() and int(gpus) > 0:
        return max(1, int(cpus) // int(gpus))
    return None


def _cpus_per_task(opts: LaunchOptions, gpus: int) -> list[str]:
    return [] if opts.cpus_per_gpu is None else [f"--cpus-per-task={opts.cpus_per_gpu * gpus}"]


def _srun_common(opts: LaunchOptions) -> list[str]:
    out = []
    if opts.container_image:
        out.append(f"--container-image={opts.container_image}")
        if opts.container_mounts:
            out.append(f"--container-mounts={opts.container_mounts}")
    return out + list(opts.srun_args)


def _master_port(job_id: int, taken: set[int]) -> int:
    port = 20000 + job_id % 10000
    while port in taken:
        port += 1
    return port


def preview_allocation(cfg: RunConfig) -> SlurmEnv:
    """The allocation the config asks for, on placeholder hosts node01..nodeN (job id 0): checks and previews."""
    launch = cfg.launch
    width = max(2, len(str(launch.nodes)))
    nodes = tuple(f"node{i:0{width}d}" for i in range(1, launch.nodes + 1))
    return SlurmEnv(job_id="0", nodes=nodes, gpus_per_node=launch.gpus_per_node)
