"""Per-step throughput metrics: tokens per GPU per second, model FLOPs utilisation, peak memory.

    perf/tokens_per_gpu_per_s = Σ lengths (prompt + response tokens the update trained on)
                                / (step time · world size)
    perf/mfu                  = epochs · Σ_i s_i·F(s_i) / (update time · world size · peak)
    perf/peak_memory_gib      = max over ranks of this step's peak device memory (CUDA allocator),
                                or of the process's peak resident memory on CPU runs

F(s) is the training FLOPs per token of `armor_megatron.models.flops`; the peak is
``launch.gpu_peak_tflops`` (MFU is left out when it is not set).
"""

from __future__ import annotations

import resource

import torch

from armor_megatron.models.arch import ModelArch
from armor_megatron.models.flops import train_flops
from armor_megatron.trainer.collectives import max_over_ranks

GIB = 1 << 30


def reset_peak_memory() -> None:
    """Reset the CUDA peak-memory counters (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float:
    """This step's peak on this rank (CUDA), or the process's lifetime peak RSS (CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


def throughput_metrics(
    arch: ModelArch,
    lengths: torch.Tensor | None,
    *,
    step_seconds: float,
    update_seconds: float,
    epochs: int,
    world_size: int,
    peak_tflops: float | None,
) -> dict[str, float]:
    """The metrics of the module docstring (every rank calls it: the memory peak is a collective)."""
    out = {"perf/peak_memory_gib": max_over_ranks(peak_memory_gib())}
    if lengths is None:  # nothing trained this step
        return out
    tokens = float(lengths.sum())
    out["perf/tokens_per_gpu_per_s"] = tokens / max(step_seconds, 1e-9) / world_size
    if peak_tflops and update_seconds > 0:
        flops = epochs * train_flops(arch, lengths.tolist())
        out["perf/mfu"] = flops / (update_seconds * world_size * peak_tflops * 1e12)
    return out
