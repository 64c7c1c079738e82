"""What LoRA saves: per-GPU state bytes, the step's peak and the step time, LoRA over full fine-tuning.

State bytes (per GPU): the trained model's weights, gradient buffers and optimizer state (fp32
masters and Adam moments) plus the reference model's weights -- what a run holds between steps.

1. **The 7B recipe's layout, from the planner** (`launch.memory.plan_memory`): the recipe
   ``configs/qwen25_math_7b_dapo_armor.yaml`` at its tp/dp on 8 GPUs, bf16, LoRA rank ``--rank``
   (alpha 2·rank, every target) against full fine-tuning. LoRA needs the local layer spec without
   sequence parallelism, so both sides are planned with ``model.spec: local`` and ``sp: false``.
   ``peak_bytes_lora_over_full`` is the planner's whole step peak (activations included), the
   largest phase of the step over the stages.
2. **A measured tiny model** (Qwen2-shaped, one CPU process): the distinct tensor storages the actor
   and reference hold after a train step (`megatron.offload.model_tensors`: parameters and buffers,
   DDP's gradient buffers, the optimizer's masters and moments), full (actor + `ReferenceModel`)
   against LoRA (adapted actor + `LoRAReference`, which holds nothing), bf16 (``--dtype``).
3. ``step_time_lora_over_full``: the median wall time of a tiny actor's ``train_step`` (CPU), LoRA
   over full, measured side by side in this process, the two variants' steps interleaved.

The last line is ``state_bytes_lora_over_full=<7B> state_bytes_lora_over_full_tiny=<measured>
peak_bytes_lora_over_full=<7B> step_time_lora_over_full=<CPU>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout too
from armor_megatron.config import load_config
from armor_megatron.config.validate import model_arch_of
from armor_megatron.launch.memory import plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")
STATE_TERMS = ("weights", "gradients", "optimizer", "reference")


def planned(rank: int) -> tuple[float, float, float, float]:
    """(state bytes full, LoRA; peak bytes full, LoRA) per GPU of the 7B recipe's worst stage."""
    out = []
    for lora in (False, True):
        overrides = ["model.spec=local", "parallelism.sp=false", "model.dtype=bfloat16"]
        if lora:
            overrides += ["lora.enabled=true", f"lora.rank={rank}", f"lora.alpha={2 * rank}"]
        cfg = load_config(SEVEN_B, overrides)
        arch = model_arch_of(cfg)
        assert arch is not None, "the 7B recipe declares its model.arch"
        plan = plan_memory(cfg, arch)
        state = max(sum(st.terms[k] for k in STATE_TERMS) for st in plan.stages)
        peak = max(p.total for st in plan.stages for p in st.phases)
        out.append((state, peak, plan.layout))
    (state_full, peak_full, layout), (state_lora, peak_lora, _) = out
    print(f"7B recipe ({layout}), rank {rank}, bf16, per GPU:")
    print(f"  state  full {state_full / 2**30:.2f} GiB  lora {state_lora / 2**30:.2f} GiB")
    print(f"  peak   full {peak_full / 2**30:.2f} GiB  lora {peak_lora / 2**30:.2f} GiB")
    return state_full, state_lora, peak_full, peak_lora


def _tiny_arch():
    from armor_megatron.models.arch import ModelArch

    return ModelArch(
        family="qwen2",
        vocab_size=512,
        hidden_size=256,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        ffn_hidden_size=704,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        qkv_bias=True,
        dtype="bfloat16",
    )


def _state_bytes(*models) -> int:
    from armor_megatron.megatron.offload import model_tensors

    storages = {}
    for model in models:
        for t in model_tensors(model):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measured(rank: int, steps: int, dtype: str = "bfloat16") -> tuple[float, float]:
    """(state bytes LoRA / full, median step time LoRA / full) of the tiny model in this process."""
    from armor_megatron.algo.loss import PolicyLossConfig
    from armor_megatron.config.schema import OptimizerConfig
    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.dist import ParallelConfig
    from armor_megatron.megatron.lora import LoRAReference, LoRASettings
    from armor_megatron.megatron.reference import ReferenceModel
    from armor_megatron.megatron.trained_model import ModelSettings

    arch = _tiny_arch()
    mdist.initialize(ParallelConfig(), arch, environ={})
    try:
        g = torch.Generator().manual_seed(0)
        rows, length = 8, 128
        ids = torch.randint(0, arch.vocab_size, (rows, length), generator=g)
        lengths = torch.full((rows,), length)
        mask = torch.arange(length)[None].expand(rows, -1) >= 32
        settings = ModelSettings(arch, ParallelConfig(), dtype=dtype, micro_batch_size=4)
        models = {}
        mdist.set_model_parallel(ParallelConfig(), arch, seed=1)
        for name, lora in (("full", None), ("lora", LoRASettings(rank=rank, alpha=2.0 * rank))):
            actor = MegatronActor(
                settings,
                optimizer=OptimizerConfig(lr=1e-4),
                loss=PolicyLossConfig(alpha=0.9),
                total_steps=100,
                seed=1,
                lora=lora,
            )
            reference = LoRAReference(actor) if lora else ReferenceModel(settings)
            lp = actor.compute_logprobs(ids, lengths).logprobs
            batch = dict(
                input_ids=ids,
                lengths=lengths,
                response_mask=mask,
                advantages=torch.randn(rows, generator=g),
                old_logprobs=lp,
                ref_logprobs=lp,
            )
            actor.train_step(batch)  # the optimizer's state exists before the bytes are counted
            models[name] = (actor, reference, batch, [])
        for _ in range(steps):  # interleaved, so that a busy machine slows both alike
            for actor, _, batch, times in models.values():
                start = time.perf_counter()
                actor.train_step(batch)
                times.append(time.perf_counter() - start)
        result = {}
        for name, (actor, reference, _, times) in models.items():
            result[name] = (_state_bytes(actor, reference), statistics.median(times))
            print(
                f"tiny {name} ({dtype}): state {result[name][0] / 2**20:.2f} MiB, median step {result[name][1]:.3f} s"
            )
        return result["lora"][0] / result["full"][0], result["lora"][1] / result["full"][1]
    finally:
        mdist.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (alpha = 2·rank)")
    parser.add_argument("--tiny-rank", type=int, default=16, help="LoRA rank of the measured tiny model")
    parser.add_argument("--steps", type=int, default=9, help="timed train steps per variant (interleaved)")
    parser.add_argument("--dtype", default="bfloat16", help="the tiny model's dtype (bfloat16 | float32)")
    args = parser.parse_args()
    state_full, state_lora, peak_full, peak_lora = planned(args.rank)
    tiny_state, step_time = measured(args.tiny_rank, args.steps, args.dtype)
    print(
        f"state_bytes_lora_over_full={state_lora / state_full:.3f} state_bytes_lora_over_full_tiny={tiny_state:.3f} "
        f"peak_bytes_lora_over_full={peak_lora / peak_full:.3f} step_time_lora_over_full={step_time:.3f}"
    )


if __name__ == "__main__":
    main()
