"""Padding waste and train-step time: token-budget packed micro-batches vs padded row micro-batches.

Workload (a DAPO-shaped step, scaled to a CPU): 48 rows, each a prompt of 50–500 tokens and a
response drawn long-tailed (50 + exponential, mean ~350 tokens) and cut at ``--max-response``
(1024), with a third of the responses truncated at that maximum, as DAPO's overlong rows are.
Model: a 4-layer Qwen3-shaped Megatron GPT (hidden 128, vocabulary 4,096) on the local spec,
fp32, TP = PP = DP = 1, gloo, CPU.

* rows:   ``micro_batch_size=4`` rows per micro-batch, each padded to its longest row (today's
          default path; rows in rollout order).
* packed: ``train.max_tokens_per_micro_batch=4096``: rows packed back to back (THD), first-fit
          decreasing, each micro-batch at most 4,096 tokens.

Both run the same weights on the same batch: ``compute_logprobs`` (old log-probs) and one
``train_step``, timed together; the best of ``--repeats`` after one warm-up. Padding waste is
1 − real tokens / tokens the model ran, counted on the micro-batches the trainer actually built.
The losses of the two paths are printed too: packing must not change them.

The last line is exactly ``padding_waste_rows=<f> padding_waste_packed=<f>
time_ratio_packed_vs_rows=<f>``. Targets: packed waste ≤ 0.05, time ratio ≤ 0.6.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import time


def dapo_lengths(rows: int, max_response: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        prompt = rng.randint(50, 500)
        truncated = rng.random() < 1 / 3
        response = max_response if truncated else min(max_response, int(50 + rng.expovariate(1 / 300)))
        out.append((prompt, response))
    return out


def make_batch(shapes, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([p + r for p, r in shapes])
    width = int(lengths.max())
    ids = torch.randint(1, vocab, (len(shapes), width), generator=g)
    t = torch.arange(width)[None]
    prompts = torch.tensor([p for p, _ in shapes])[:, None]
    return dict(
        input_ids=ids,
        lengths=lengths,
        response_mask=(t >= prompts) & (t < lengths[:, None]),
        advantages=torch.randn(len(shapes), generator=g),
    )


def waste(microbatches) -> float:
    real = sum(int(t.mb.lengths.sum()) for t in microbatches if len(t.mb.index))
    ran = sum(t.mb.tokens.numel() for t in microbatches)
    return 1.0 - real / ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import torch.distributed

    from armor_megatron.algo.loss import PolicyLossConfig
    from armor_megatron.config.schema import OptimizerConfig
    from armor_megatron.megatron import dist as mdist
    from armor_megatron.megatron.actor import MegatronActor
    from armor_megatron.megatron.dist import ParallelConfig
    from armor_megatron.megatron.microbatch import TokenBudget
    from armor_megatron.megatron.trained_model import ModelSettings
    from armor_megatron.models.arch import ModelArch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    arch = ModelArch(
        family="qwen3",
        vocab_size=4096,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        ffn_hidden_size=384,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        qk_norm=True,
        tie_word_embeddings=True,
        dtype="float32",
    )
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    mdist.initialize(ParallelConfig(), arch, seed=1)
    batch = make_batch(dapo_lengths(args.rows, args.max_response, args.seed), arch.vocab_size, args.seed)
    print(f"rows={args.rows} tokens={int(batch['lengths'].sum())} longest={int(batch['lengths'].max())}")
    results = {}
    for name, budget in (("rows", TokenBudget()), ("packed", TokenBudget(args.budget, args.budget))):
        actor = MegatronActor(
            ModelSettings(arch, ParallelConfig(), dtype="float32", micro_batch_size=4, token_budget=budget),
            optimizer=OptimizerConfig(lr=1e-5),
            loss=PolicyLossConfig(alpha=0.9),
            total_steps=10,
            seed=3,
        )
        microbatches = actor._local_microbatches(
            {**batch, "old_logprobs": torch.zeros(batch["input_ids"].shape, dtype=torch.float32)}
        )
        state = {k: v.clone() for c in actor.model_chunks for k, v in c.state_dict().items() if torch.is_tensor(v)}

        def step(actor=actor, state=state):
            for chunk in actor.model_chunks:  # every repeat from the same weights
                chunk.load_state_dict({**chunk.state_dict(), **state}, strict=False)
            lp = actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs
            return actor.train_step({**batch, "old_logprobs": lp.detach(), "ref_logprobs": lp.detach()})

        step()
        times, loss = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            loss = step()["loss"]
            times.append(time.perf_counter() - start)
        results[name] = dict(waste=waste(microbatches), time=min(times), loss=loss, micro_batches=len(microbatches))
        print(
            f"{name}: micro_batches={len(microbatches)} waste={results[name]['waste']:.3f} "
            f"step_s={min(times):.2f} loss={loss:.6f}"
        )
    mdist.shutdown()
    del store
    rows, packed = results["rows"], results["packed"]
    print(
        f"padding_waste_rows={rows['waste']:.4f} padding_waste_packed={packed['waste']:.4f} "
        f"time_ratio_packed_vs_rows={packed['time'] / rows['time']:.4f}"
    )


if __name__ == "__main__":
    main()
