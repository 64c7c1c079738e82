"""Check 3: training throughput (tokens/s) and MFU of the actor's train step on a ~0.5B model.

    python tools/gpu_check/check_throughput.py [--device cuda|cpu] [--shape qwen2.5-0.5b|tiny]
        [--seq-len 4096] [--batch 8] [--steps 5] [--warmup 2] [--peak-tflops 989] [--json PATH]

A randomly initialised model of Qwen2.5-0.5B's shape (24 layers, h 896, 14 query / 2 KV heads of
d 64, f 4864, V 151936, tied embeddings) is built by the package (``MegatronActor``: local spec,
bf16 with fp32 master weights, the product's default optimizer and ARMOR loss). One step is
``actor.train_step`` on ``--batch`` random sequences of ``--seq-len`` tokens (one per
micro-batch, every position but the first a response token): forward, backward, the guarded
Adam update. After ``--warmup`` steps, ``--steps`` steps are timed (device synchronised).

    tokens/s = batch · seq_len · steps / seconds
    MFU      = tokens/s · F / peak,   peak = 989e12 FLOP/s (H200 SXM bf16 dense, datasheet)

F, the model FLOPs of training per token: `armor_megatron.models.flops` (the trainer's perf/mfu
uses the same count). With the local spec attention is computed unfused over the full s×s
matrix, so the hardware does more than F.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import report, select_device, single_process_env  # noqa: E402

from armor_megatron.models.flops import train_flops_per_token  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0

# HF config.json fields of the benchmarked shapes (random weights: nothing is downloaded).
SHAPES = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "tiny": {  # the CPU mode's stand-in: same code path, seconds on two cores
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch each)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("seq_len", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len > SHAPES[args.shape]["max_position_embeddings"]:
        p.error(f"--seq-len {args.seq_len} exceeds the {args.shape} shape's max_position_embeddings")
    return args


def random_batch(arch, batch: int, seq_len: int, seed: int) -> dict:
    """Random token rows, all of length `seq_len`, every position t >= 1 a response token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=gen)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    mask[:, 0] = False
    return {
        "input_ids": ids,
        "lengths": torch.full((batch,), seq_len),
        "response_mask": mask,
        "advantages": torch.randn(batch, generator=gen),
    }


def random_actor(arch, parallel, *, total_steps: int, seed: int):
    """The product's actor (bf16, local spec, default optimizer, ARMOR loss), randomly initialised;
    one row per micro-batch."""
    import torch

    from armor_megatron.algo.loss import PolicyLossConfig
    from armor_megatron.config.schema import OptimizerConfig
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.trained_model import ModelSettings

    return MegatronActor(
        ModelSettings(arch, parallel, dtype=torch.bfloat16),
        optimizer=OptimizerConfig(),
        loss=PolicyLossConfig(alpha=0.9375),
        total_steps=total_steps,
        seed=seed,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    select_device(args.device)
    single_process_env()
    import torch

    from armor_megatron.megatron import dist
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_config(SHAPES[args.shape])
    parallel = dist.ParallelConfig()
    ctx = dist.initialize(parallel, arch, seed=args.seed)
    try:
        actor = random_actor(arch, parallel, total_steps=args.warmup + args.steps, seed=args.seed)
        params = sum(p.numel() for p in actor.model_chunks[0].parameters())
        batch = random_batch(arch, args.batch, args.seq_len, args.seed)
        lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs.cpu()
        batch.update(old_logprobs=lp, ref_logprobs=lp)  # π_old = π_ref = π_θ at the start, as at a reset
        cuda = ctx.device.type == "cuda"

        def sync():
            if cuda:
                torch.cuda.synchronize()

        skipped = 0.0
        for _ in range(args.warmup):
            actor.train_step(batch)
        sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            skipped += actor.train_step(batch)["skipped"]
        sync()
        seconds = time.perf_counter() - started
        memory_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    finally:
        dist.shutdown()
    tokens_per_s = args.batch * args.seq_len * args.steps / seconds
    flops = train_flops_per_token(arch, args.seq_len)
    mfu = tokens_per_s * flops / (args.peak_tflops * 1e12)
    ok = tokens_per_s > 0 and skipped == 0
    line = (
        f"{args.shape} ({params / 1e6:.3g}M params, random) train_step on {ctx.device.type}/{ctx.backend} bf16, "
        f"seq {args.seq_len} x {args.batch} per step, {args.steps} steps in {seconds:.2f} s: "
        f"tokens_per_s={tokens_per_s:.1f} mfu={mfu:.4g} (F={flops / 1e9:.3f} GFLOP/token, peak {args.peak_tflops:g} TFLOP/s)"
        + (f", peak memory {memory_gib:.1f} GiB" if cuda else "")
        + (f"; {skipped:.0f} updates skipped" if skipped else "")
    )
    report(
        args.json,
        "throughput",
        ok,
        line,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        flops_per_token=flops,
        params=params,
        seconds=seconds,
        device=ctx.device.type,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
