"""What a run config's settings need on the job's machines, and whether this machine has it.

``armor-train --check`` prints `describe(cfg)`, one line naming each package or tool the chosen
settings need and the key that asks for it, so a recipe prepared on a laptop says what its GPU
image must hold. `check(cfg)` probes this machine (run by `config.files.check_files`, so at the
start of every job and by ``--check`` unless ``--no-files``) and raises a one-line ConfigError
for the first required one that is missing. Probes look packages up without importing them,
except the SGLang interpreter, which is asked in a subprocess when it is not this one.

Needs (GPU runs: ``launch.gpus_per_node > 0``):

* ``model.spec: te``: Transformer Engine and its torch extension (``auto`` uses them when present
  and the local spec otherwise: listed, not required);
* ``throughput.gradient_accumulation_fusion``: APEX's ``fused_weight_gradient_mlp_cuda``;
* ``throughput.torch_compile``: Triton and a C compiler (GPU), a C++ compiler (CPU);
* ``moe.token_dispatcher_type: flex`` (MoE models): DeepEP;
* launched SGLang servers (``rollout.engine: sglang`` without ``rollout.sglang.urls``): sglang
  importable by ``rollout.sglang.python`` (the trainer's interpreter when null);
* ``rollout.sglang.weight_sync`` distributed or tensor with ``rollout.sglang.python`` set: the
  same NCCL (distributed) or torch (tensor) there as here (`armor_megatron.config.comm_versions`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from armor_megatron.config.comm_versions import ProbeError, interpreter_versions, local_versions, sync_problem
from armor_megatron.config.schema import RunConfig, SGLangConfig
from armor_megatron.config.typed import ConfigError
from armor_megatron.models.megatron_options import deep_ep_available, grad_accumulation_fusion_available

ENV_DOC = "docs/gpu.md, GPU environments"
PROBE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Need:
    """One thing a setting needs on this machine (a package, a device), and how to probe for it."""

    key: str  # the setting that asks for it
    what: str  # what it needs, in words
    probe: Callable[[], str | None]  # None when this machine has it, else what is missing
    required: bool = True


def _missing_modules(*modules: str) -> str | None:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not importable" if absent else None


def _compiler(names: tuple[str, ...], env: str) -> str | None:
    if os.environ.get(env) or any(shutil.which(n) for n in names):
        return None
    return f"no compiler found (${env}, {', '.join(names)})"


def sglang_probe(python: str | None) -> Callable[[], str | None]:
    """Whether `python` (None: this interpreter) can import sglang, asked without importing it."""

    def probe() -> str | None:
        if python is None:
            return None if importlib.util.find_spec("sglang") else f"sglang not importable by {sys.executable}"
        exe = shutil.which(python) if os.sep not in python else python
        if exe is None or not os.access(exe, os.X_OK):
            return f"{python}: no such interpreter"
        code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
        try:
            done = subprocess.run([exe, "-c", code], capture_output=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{python}: {err}"
        return None if done.returncode == 0 else f"sglang not importable by {python}"

    return probe


def needs(cfg: RunConfig) -> list[Need]:
    """What the config's settings need on the job's machines."""
    gpu_run, th, out = cfg.launch.gpus_per_node > 0, cfg.throughput, []
    if gpu_run and cfg.model.spec in ("te", "auto"):
        out.append(
            Need(
                "model.spec",
                "Transformer Engine with its torch extension (transformer_engine, transformer_engine_torch)",
                lambda: _missing_modules("transformer_engine", "transformer_engine_torch"),
                required=cfg.model.spec == "te",
            )
        )
    if th.gradient_accumulation_fusion:
        out.append(
            Need(
                "throughput.gradient_accumulation_fusion",
                "APEX's fused_weight_gradient_mlp_cuda (NVIDIA Apex built from source)",
                lambda: (
                    None if grad_accumulation_fusion_available() else "fused_weight_gradient_mlp_cuda not importable"
                ),
            )
        )
    if th.torch_compile:
        if gpu_run:
            out.append(
                Need(
                    "throughput.torch_compile",
                    "Triton and a C compiler (torch.compile builds kernels and their launchers at run time)",
                    lambda: _missing_modules("triton") or _compiler(("cc", "gcc", "clang"), "CC"),
                )
            )
        else:
            out.append(
                Need(
                    "throughput.torch_compile",
                    "a C++ compiler (torch.compile builds CPU kernels at run time)",
                    lambda: _compiler(("g++", "c++", "clang++"), "CXX"),
                )
            )
    if cfg.moe.token_dispatcher_type == "flex":
        out.append(
            Need(
                "moe.token_dispatcher_type",
                "DeepEP (flex dispatcher, MoE models)",
                lambda: None if deep_ep_available() else "deep_ep not importable",
            )
        )
    sg = cfg.rollout.sglang
    if cfg.rollout.engine == "sglang" and not sg.urls:
        where = sg.python or "the trainer's interpreter"
        out.append(Need("rollout.sglang.python", f"sglang importable by {where}", sglang_probe(sg.python)))
    if cfg.rollout.engine == "sglang" and sg.python and sg.weight_sync in ("distributed", "tensor"):
        what = "NCCL" if sg.weight_sync == "distributed" else "torch"
        out.append(Need("rollout.sglang.weight_sync", f"one {what} for trainer and engines", comm_probe(sg)))
    return out


def comm_probe(sg: SGLangConfig) -> Callable[[], str | None]:
    """Whether the trainer and ``sg.python`` share what ``sg.weight_sync`` spans (one subprocess)."""

    def probe() -> str | None:
        python = sg.python or sys.executable
        try:
            engines = interpreter_versions(python)
        except ProbeError as err:
            return str(err)
        return sync_problem(sg.weight_sync, local_versions(), engines, python)

    return probe


def describe(cfg: RunConfig) -> str | None:
    """One line: what the job's machines need and which key asks for it (None when nothing)."""
    found = needs(cfg)
    if not found:
        return None
    parts = [f"{n.what} [{n.key}{'' if n.required else ', optional'}]" for n in found]
    return "the job's machines need: " + "; ".join(parts)


def check(cfg: RunConfig) -> None:
    """Raise ConfigError for the first required need this machine lacks."""
    for need in needs(cfg):
        if not need.required:
            continue
        missing = need.probe()
        if missing:
            raise ConfigError(need.key, f"needs {need.what}, but here {missing} ({ENV_DOC})")
