"""Converter throughput and memory, side by side with ``cp`` of the same bytes.

    python bench/convert_throughput.py [--workdir DIR] [--only llama|70b-slice|v2-lite-slice]

Builds synthetic bf16 HF checkpoints in a temporary directory (removed at the end):

* ``llama``: Llama-2-7B-shaped (hidden 4096, 32 heads, ffn 11008, vocab 32000), 4 layers, ~2.1 GB;
* ``70b-slice``: Llama-3-70B-shaped (hidden 8192, 64 heads / 8 kv heads, ffn 28672,
  vocab 128256), 2 layers, ~7.6 GB;
* ``v2-lite-slice`` (only when asked for with ``--only``): DeepSeek-V2-Lite-shaped (hidden 2048,
  MLA with kv LoRA rank 512, vocab 102400, 64 routed experts of ffn 1408 + 2 shared), its first
  (dense, ffn 10944) and second (MoE) layers, ~2.1 GB: many small expert tensors, per-layer keys.

For each it converts HF -> torch_dist -> HF (each direction in a fresh process, whose own
peak RSS is recorded), checks the round trip bit for bit, and times ``cp -r`` of the same
input directory in the same run. Conversion time is measured inside the converting process
from the call to the return (interpreter start and imports are printed separately). Both sides
read from a warm page cache and start with no dirty pages (sync). Other jobs load the shared
development machines, so each side is timed ``--repeat`` times, interleaved, and the best of
each counts (all timings are printed). The last line is the worse of all runs:
``time_ratio_vs_cp=<float> peak_rss_over_largest_tensor=<float>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
SHAPES = {
    "llama": dict(
        **LLAMA,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        num_hidden_layers=4,
    ),
    "70b-slice": dict(
        **LLAMA,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        num_hidden_layers=2,
    ),
    "v2-lite-slice": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=10944,
        vocab_size=102400,
        num_hidden_layers=2,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
}
DEFAULT = ["llama", "70b-slice"]


def write_synthetic(path: str, shape: dict) -> int:
    """Write a bf16 checkpoint of config ``shape`` (5 GB shards, streamed); returns the largest tensor's bytes."""
    import torch

    from armor_megatron.convert.hf_io import PlannedTensor, SafetensorsWriter
    from armor_megatron.convert.rules import hf_shapes, tensor_rules
    from armor_megatron.models import ModelArch

    config = {"torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu", **shape}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    arch = ModelArch.from_hf_config(config)
    planned = [
        PlannedTensor(name, s, torch.bfloat16)
        for rule in tensor_rules(arch)
        for layer, expert in rule.indices(arch)
        for name, s in zip(rule.hf(layer, expert), hf_shapes(arch, rule))
    ]
    writer = SafetensorsWriter(path, planned, 5 * 10**9)
    block = torch.randn(2**20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for t in planned:  # random-looking bytes without paying for a full randn per tensor
        data = torch.empty(t.shape, dtype=torch.bfloat16).reshape(-1)
        for start in range(0, data.numel(), block.numel()):
            data[start : start + block.numel()] = block[: data.numel() - start]
        writer.write(t.name, data.reshape(t.shape))
        del data
    writer.close()
    return max(t.nbytes for t in planned)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def child(direction: str, src: str, dst: str) -> None:
    """Run one conversion in this fresh process; print timings and peak RSS as JSON."""
    start = time.monotonic()
    import torch.distributed.checkpoint  # noqa: F401  (loaded lazily by the converter)

    from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from armor_megatron.convert.progress import peak_rss_bytes, release_large_frees_to_os

    release_large_frees_to_os()  # as the armor-convert command does
    imports, baseline = time.monotonic() - start, peak_rss_bytes()
    os.sync()  # start with no dirty pages, like the cp timings
    start = time.monotonic()
    convert = convert_hf_to_mcore if direction == "hf-to-mcore" else convert_mcore_to_hf
    summary = convert(src, dst, progress_stream=None)
    print(
        json.dumps(
            {
                "seconds": time.monotonic() - start,
                "imports_s": imports,
                "baseline_rss": baseline,
                "peak_rss": peak_rss_bytes(),
                "bytes": summary.bytes,
            }
        )
    )


def run_child(direction: str, src: str, dst: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", direction, src, dst],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode:
        sys.exit(f"{direction} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_cp(src: str, dst: str) -> float:
    os.sync()  # writes are throttled once dirty pages pile up: start every timing clean
    start = time.monotonic()
    subprocess.run(["cp", "-r", src, dst], check=True)
    seconds = time.monotonic() - start
    shutil.rmtree(dst)
    return seconds


def _fmt(seconds) -> str:
    return "/".join(f"{s:.2f}" for s in seconds)


def bench(name: str, workdir: str, repeat: int) -> tuple[float, float]:
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.convert.verify import compare_tensors

    hf, mcore, back = (os.path.join(workdir, f"{name}-{x}") for x in ("hf", "mcore", "back"))
    largest = write_synthetic(hf, SHAPES[name])
    size = du(hf)
    gib = 2**30
    print(
        f"[{name}] synthetic bf16 checkpoint: {size / gib:.2f} GiB, largest tensor {largest / gib:.3f} GiB", flush=True
    )
    ratios = []
    for direction, src, dst in (("hf-to-mcore", hf, mcore), ("mcore-to-hf", mcore, back)):
        time_cp(src, dst + ".warm")  # same warm-cache start for both sides
        cp_times, results = [], []
        for attempt in range(repeat):  # interleaved, best of `repeat`: other jobs load this machine
            cp_times.append(time_cp(src, dst + ".cp"))
            if attempt:
                shutil.rmtree(dst)
            results.append(run_child(direction, src, dst))
        cp_s, seconds = min(cp_times), min(r["seconds"] for r in results)
        peak, imports = max(r["peak_rss"] for r in results), min(r["imports_s"] for r in results)
        time_ratio, rss_ratio = seconds / cp_s, peak / largest
        ratios.append((time_ratio, rss_ratio))
        print(
            f"[{name}] {direction}: {seconds:.2f} s (+{imports:.1f} s start-up) vs cp {cp_s:.2f} s of "
            f"{du(src) / gib:.2f} GiB (best of {repeat}; all: {_fmt(r['seconds'] for r in results)} vs "
            f"{_fmt(cp_times)}) -> time ratio {time_ratio:.2f}; peak RSS {peak / gib:.2f} GiB (after imports "
            f"{results[0]['baseline_rss'] / gib:.2f} GiB) = {rss_ratio:.2f} x largest tensor",
            flush=True,
        )
    compared, mismatched = compare_tensors(HFCheckpoint(hf), HFCheckpoint(back))
    if mismatched:
        sys.exit(f"[{name}] round trip differs: {mismatched[:3]}")
    print(f"[{name}] round trip: {compared} tensors bit-identical", flush=True)
    for path in (hf, mcore, back):
        shutil.rmtree(path)
    return max(r[0] for r in ratios), max(r[1] for r in ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="where the temporary checkpoints go (default: system temp)")
    parser.add_argument("--only", choices=sorted(SHAPES), action="append")
    parser.add_argument("--repeat", type=int, default=3, help="timings per side; the best counts (default 3)")
    parser.add_argument("--child", nargs=3, metavar=("DIRECTION", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory(prefix="armor_convert_bench_", dir=args.workdir) as workdir:
        results = [bench(name, workdir, args.repeat) for name in (args.only or DEFAULT)]
    print(
        f"time_ratio_vs_cp={max(r[0] for r in results):.3f} "
        f"peak_rss_over_largest_tensor={max(r[1] for r in results):.3f}"
    )


if __name__ == "__main__":
    main()
