"""Generated-token cost of ARMOR anchors, relative to on-policy rollouts only, with and without the anchor cache.

Setup: a tiny confident Qwen2 (CPU, local engines) is both the policy and the frozen
reference (ARMOR starts with π_ref = π_0); no training happens, only rollout cost is
measured. Each prompt's ground truth is the reference's rank-r most likely first character
(r = 0, 0, 1, 2) or unreachable ('#'), so prompts range from easy to unsolvable. Per step
and prompt, with group size G:

* baseline ........ G on-policy samples;
* anchors ......... G−1 on-policy samples + up to ``max_tries`` reference samples
                    (``tries_per_request`` at once); one more on-policy sample if no anchor;
* anchors + cache . the same, but anchors come from the per-prompt pool when it has one
                    (zero cost), pools fill from earlier rounds, are pre-generated for the
                    next batch in the background, and are dropped at every reference reset
                    (every ``tau`` steps); prompts that failed once are skipped until the reset
                    (also reported without that skipping: ``cache_always_retry``).

cost = (on-policy tokens + reference tokens) / baseline tokens, over the whole run, each
variant generating for real in this one process. The paper pays about 1.25×.
The last line is ``cost_no_cache=<float> cost_with_cache=<float>``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout too
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorSampler, AnchorSamplingConfig
from armor_megatron.rollout.anchor.source import SeparateReference
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.tiny_models import ALPHABET, build_char_tokenizer, encode, tiny_config, tiny_weights

UNREACHABLE = "#"
RANKS = (0, 0, 1, 2, None)


def starts_with(text: str, gt: str) -> float:
    return float(text.startswith(gt))


def make_dataset(ref: LocalEngine, tok, num_prompts: int, seed: int):
    """Random prompts; ground truth = the reference's rank-r first character per RANKS, or unreachable."""
    rng = random.Random(seed)
    letters = ALPHABET.replace(" ", "")
    prompts, truths, p_solve = [], [], []
    for i in range(num_prompts):
        ids = encode(tok, "".join(rng.choice(letters) for _ in range(rng.randint(3, 6))))
        with torch.no_grad():
            probs = torch.softmax(ref.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        rank = RANKS[i % len(RANKS)]
        if rank is None:
            truths.append(UNREACHABLE)
            p_solve.append(0.0)
        else:
            tok_id = int(torch.argsort(probs, descending=True)[rank])
            truths.append(tok.decode([tok_id]))
            p_solve.append(float(probs[tok_id]))
        prompts.append(ids)
    return prompts, truths, p_solve


def tokens(groups) -> int:
    return sum(s.num_tokens for g in groups for s in g)


def run(variant: str, args, cfg, weights, tok, prompts, truths) -> dict:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    policy = LocalEngine(cfg, weights, tokenizer=tok, weight_version="policy-0", seed=args.seed)
    reference = SeparateReference(LocalEngine(cfg, weights, tokenizer=tok, weight_version="ref-0", seed=args.seed + 1))
    sampler = AnchorSampler(
        reference, starts_with, AnchorSamplingConfig(args.max_tries, args.tries_per_request, sampling=sampling)
    )
    cache = None
    if variant.startswith("cache"):
        cache = AnchorCache(sampler, give_up_after=1 if variant == "cache" else None)
    batches = [list(range(s, s + args.batch_size)) for s in range(0, len(prompts), args.batch_size)]
    schedule = [b for _ in range(args.epochs) for b in batches]
    on_policy, found, slots = 0, 0, 0
    for step, idx in enumerate(schedule):
        if step and step % args.tau == 0:
            reference.reset(weights, version=f"ref-{step}")  # θ_ref ← θ (no training here: same weights)
        p, t = [prompts[i] for i in idx], [truths[i] for i in idx]
        if variant == "baseline":
            on_policy += tokens(policy.generate(p, args.group_size, sampling))
            continue
        results = cache.get(p, t, keys=idx) if cache is not None else sampler.sample(p, t)
        if cache is not None and step + 1 < len(schedule) and (step + 1) % args.tau:
            nxt = schedule[step + 1]  # pre-generate while "the trainer updates"
            cache.prefetch([prompts[i] for i in nxt], [truths[i] for i in nxt], keys=nxt)
        groups = policy.generate(p, args.group_size - 1, sampling)
        missing = [i for i, r in enumerate(results) if not r.found]
        if missing:  # no anchor: fill the slot with one more on-policy sample
            groups += policy.generate([p[i] for i in missing], 1, sampling)
        on_policy += tokens(groups)
        found += len(results) - len(missing)
        slots += len(results)
    if cache is not None:
        cache.wait()
    out = {"on_policy_tokens": on_policy, "reference_tokens": sampler.stats.generated_tokens}
    if variant != "baseline":
        out["anchor_rate"] = found / slots
    if cache is not None:
        out["cache_hit_rate"] = cache.stats.hit_rate
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--tau", type=int, default=6, help="reference reset period in steps (the paper uses 160 for 7B)")
    ap.add_argument("--max-tries", type=int, default=4)
    ap.add_argument("--tries-per-request", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--sharpen", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    weights = tiny_weights(cfg, seed=args.seed, sharpen=args.sharpen)
    probe = LocalEngine(cfg, weights, tokenizer=tok)
    prompts, truths, p_solve = make_dataset(probe, tok, args.num_prompts, args.seed)
    steps = args.epochs * -(-args.num_prompts // args.batch_size)
    print(
        f"prompts={args.num_prompts} G={args.group_size} epochs={args.epochs} steps={steps} tau={args.tau} "
        f"max_tries={args.max_tries} tries_per_request={args.tries_per_request} "
        f"mean_p_solve_per_try={sum(p_solve) / len(p_solve):.3f}"
    )
    results = {}
    for variant in ("baseline", "no_cache", "cache", "cache_always_retry"):
        start = time.perf_counter()
        results[variant] = r = run(variant, args, cfg, weights, tok, prompts, truths)
        print(
            f"{variant}: "
            + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
            + f" seconds={time.perf_counter() - start:.1f}"
        )
    base = results["baseline"]["on_policy_tokens"]
    cost = {
        v: (results[v]["on_policy_tokens"] + results[v]["reference_tokens"]) / base for v in results if v != "baseline"
    }
    print(
        f"cost_cache_always_retry={cost['cache_always_retry']:.4f} (give_up_after=None: failed prompts are tried at every visit)"
    )
    print(f"cost_no_cache={cost['no_cache']:.4f} cost_with_cache={cost['cache']:.4f}")


if __name__ == "__main__":
    main()
