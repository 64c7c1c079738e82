"""Start-up of a run from an HF directory: each rank reading its own slices vs converting first.

    python bench/hf_start.py [--workdir DIR] [--layers 16] [--repeat 2] [--tp 2]

Writes a synthetic bf16 Llama-shaped checkpoint (hidden 2048, 16 heads / 8 KV heads, ffn 5632,
vocab 32000; 16 layers: ~1.65 GiB) and runs the trainer's start-up at TP=2 (two ranks under
torchrun, gloo): the actor (bf16, with its fp32 master weights, optimizer and DDP buffers) and
the reference are built and get their weights, three ways:

* ``direct``: ``armor-train`` now: the models are built without random initialisation (every
  weight is loaded next) and each loads ``model.path`` itself, every rank reading only its TP
  slices (``megatron.hf_weights``);
* ``today``: ``armor-train`` before, the convert-at-start path: models built with megatron's
  random initialisation, rank 0 converts the HF directory into ``<checkpoint.dir>/base_mcore``
  (``convert_hf_to_mcore``) while the other waits, then both models load that copy with
  ``dist_checkpointing``;
* ``convert``: as ``today`` but with the models built as in ``direct``: the two differ only in how
  the weights arrive.

Time to the first training step: from the launch of ``torchrun`` to the moment both models hold
their weights on every rank (where the trainer's first step begins; the step itself is the same
either way), so process start, imports and model building count on every side. Each side runs
``--repeat`` times, interleaved, from a warm page cache; the best of each counts (all printed).

Memory: each rank resets its peak RSS (``/proc/self/clear_refs``) just before loading and reports
how far it rose while both models loaded. ``rank_peak_over_share`` is, for ``direct``, that rise
over the bytes the load filled on the rank (its share of both models' weights): built without
initialisation, the parameters' pages become resident as they are filled, so 1.0 means loading
took no memory beyond the rank's own share.

The last line: ``start_time_ratio_direct_vs_convert=<direct / today> rank_peak_over_share=<float>``
(the worst rank of any ``direct`` run); the line before it gives ``direct / convert`` too.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=5632,
    vocab_size=32000,
)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(mode: str, hf_dir: str, work: str, launched: float) -> None:
    """One rank of the start-up (run under torchrun); rank 0 prints a JSON line."""
    import torch.distributed as dist

    from armor_megatron.algo.loss import PolicyLossConfig
    from armor_megatron.config.schema import OptimizerConfig
    from armor_megatron.convert.progress import release_large_frees_to_os
    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.reference import ReferenceModel
    from armor_megatron.megatron.trained_model import ModelSettings
    from armor_megatron.models import ModelArch

    release_large_frees_to_os()
    imported = time.time() - launched
    init = mode == "today"  # armor-train before drew random initial weights, then loaded
    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = mdist.ParallelConfig(tp=int(os.environ["BENCH_TP"]))
    mdist.initialize(parallel, arch)

    settings = ModelSettings(arch, parallel, dtype="bfloat16", use_te=False, init_weights=init)
    actor = MegatronActor(
        settings, optimizer=OptimizerConfig(lr=1e-6), loss=PolicyLossConfig(alpha=0.9375), total_steps=10
    )
    reference = ReferenceModel(settings)
    built = time.time() - launched
    chunks = actor.model_chunks + reference.model_chunks
    share = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    rss_before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    if mode == "direct":
        source = hf_dir
    else:  # the start-up armor-train had before: convert once on rank 0, everyone loads the copy
        source = os.path.join(work, "base_mcore")
        if dist.get_rank() == 0 and not os.path.isdir(source):
            from armor_megatron.convert import convert_hf_to_mcore

            convert_hf_to_mcore(hf_dir, source, progress_stream=None)
        dist.barrier()
    actor.load_weights(source)
    reference.load_weights(source)
    dist.barrier()
    ready = time.time() - launched
    risen = _status_bytes("VmHWM") - rss_before
    checksum = float(next(reference.model_chunks[0].parameters()).float().abs().sum())
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, {"share": share, "risen": risen, "checksum": checksum})
    if dist.get_rank() == 0:
        out = {"imported": imported, "built": built, "ready": ready, "ranks": reports}
        print("BENCH " + json.dumps(out), flush=True)
    mdist.shutdown()


def run_side(mode: str, hf_dir: str, work: str, tp: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.sync()  # no dirty pages from the previous side
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "BENCH_TP": str(tp)}
    launched = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    cmd += [os.path.abspath(__file__), "--child", mode, hf_dir, work, repr(launched)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        sys.exit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH "))
    result = json.loads(line.removeprefix("BENCH "))
    result["converted_bytes"] = _du(os.path.join(work, "base_mcore"))
    shutil.rmtree(work, ignore_errors=True)
    return result


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="where the temporary checkpoints go (default: system temp)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the synthetic model (default 16)")
    parser.add_argument("--repeat", type=int, default=2, help="start-ups per side; the best counts (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = ranks (default 2)")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "HF_DIR", "WORK", "LAUNCHED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, hf_dir, work, launched = args.child
        child(mode, hf_dir, work, float(launched))
        return
    from convert_throughput import du, write_synthetic

    gib = 2**30
    with tempfile.TemporaryDirectory(prefix="armor_hf_start_bench_", dir=args.workdir) as workdir:
        hf_dir = os.path.join(workdir, "hf")
        write_synthetic(hf_dir, {**SHAPE, "num_hidden_layers": args.layers})
        print(f"synthetic bf16 checkpoint: {du(hf_dir) / gib:.2f} GiB, {args.layers} layers, tp={args.tp}", flush=True)
        subprocess.run(["cat", *(os.path.join(hf_dir, f) for f in os.listdir(hf_dir))], stdout=subprocess.DEVNULL)
        results: dict[str, list[dict]] = {"today": [], "convert": [], "direct": []}
        for attempt in range(args.repeat):
            for mode in results:
                r = run_side(mode, hf_dir, os.path.join(workdir, f"run-{mode}"), args.tp)
                results[mode].append(r)
                filled = r["ranks"][0]["share"]
                print(
                    f"[{mode} #{attempt + 1}] ready after {r['ready']:.1f} s (imports done {r['imported']:.1f} s, "
                    f"models built {r['built']:.1f} s, loading {r['ready'] - r['built']:.1f} s); "
                    f"loaded {filled / gib:.2f} GiB per rank, its peak RSS rose by "
                    f"{max(rk['risen'] for rk in r['ranks']) / gib:.2f} GiB; "
                    f"converted copy written: {r['converted_bytes'] / gib:.2f} GiB",
                    flush=True,
                )
        checks = {m: [rk["checksum"] for rk in rs[0]["ranks"]] for m, rs in results.items()}
        if len({tuple(c) for c in checks.values()}) != 1:
            sys.exit(f"the start-ups loaded different weights: {checks}")
    best = {m: min(r["ready"] for r in rs) for m, rs in results.items()}
    peak = max(rk["risen"] / rk["share"] for r in results["direct"] for rk in r["ranks"])
    every = {m: "/".join(f"{r['ready']:.1f}" for r in rs) for m, rs in results.items()}
    print(
        f"best of {args.repeat}: direct {best['direct']:.1f} s, today {best['today']:.1f} s, convert {best['convert']:.1f} s "
        f"(all: {every['direct']} | {every['today']} | {every['convert']}); direct / convert = "
        f"{best['direct'] / best['convert']:.3f}"
    )
    print(f"start_time_ratio_direct_vs_convert={best['direct'] / best['today']:.3f} rank_peak_over_share={peak:.3f}")


if __name__ == "__main__":
    main()
