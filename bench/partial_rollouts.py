"""Rollout time of partial rollouts (over-provision, abort, continue) against waiting for every response.

Setup: the SGLang test double (a tiny Qwen2 on CPU) with a per-token decode time
(``--seconds-per-token``, default 50 ms), so a response's time is its length. Response lengths
are long-tailed: each response's natural length is drawn from a lognormal with median
``--median`` tokens and σ = 0.47 (p99/p50 = e^(2.326σ) ≈ 3 before truncation), truncated at
the maximum length 3 × median (truncated responses are included). The engine
decodes every request at once (no batch-capacity limit: over-provisioning costs no speed
here, which real engines with a KV-cache limit do not grant in full). Rewards are drawn per
response from a per-prompt success rate (the same for both modes), so dynamic sampling drops
the groups whose rewards are all equal.

Both modes see the same prompts, lengths and rewards, step after step (the policy version
changes each step, as after an update; no training happens: the reward curve is not measured):

* off ......... each step requests the groups it needs and waits for all their responses;
                with dynamic sampling, refill rounds request the missing groups and wait again;
* partial ..... `armor_megatron.rollout.partial_generation.PartialGenerator`: over-provision
                ``--over-provision`` × the groups, accept groups as they complete (dynamic
                sampling's filter as they finish, refilled at once), abort the rest once enough
                are accepted and continue them first in the next step (staleness rule finish,
                at most ``--max-versions`` versions per response).

wasted tokens = generated tokens neither in an accepted group nor kept for a later step
(tokens of groups dynamic sampling drops are counted apart: both modes drop the same share).
The last line: ``rollout_time_ratio_partial_vs_off= wasted_token_frac_off= wasted_token_frac_partial=
max_versions_spanned= length_p99_over_p50= reward_end_off= reward_end_partial=``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout too
from armor_megatron.rollout.local import LocalEngine  # noqa: E402
from armor_megatron.rollout.partial import PartialBuffer  # noqa: E402
from armor_megatron.rollout.partial_generation import GroupRequest, PartialGenerator, percentile  # noqa: E402
from armor_megatron.rollout.sglang.client import SGLangClient, parse_output  # noqa: E402
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer  # noqa: E402
from armor_megatron.rollout.testing.tiny_models import encode, make_tiny_checkpoint  # noqa: E402

SIGMA = 0.47


def groups(args, tokenizer):
    """The endless supply of groups, the same in both modes: (request, rewards) by key."""
    i = 0
    while True:
        rng = random.Random(f"{args.seed}/{i}")
        lengths = tuple(
            max(1, min(args.max_len, round(args.median * math.exp(rng.gauss(0.0, SIGMA))))) for _ in range(args.group)
        )
        success = rng.random()
        rewards = tuple(float(rng.random() < success) for _ in range(args.group))
        yield GroupRequest(f"p{i}", tuple(encode(tokenizer, f"{i % 97}+{i % 13}=")), lengths), rewards
        i += 1


def run_off(args, client, tokenizer, sampling, dynamic):
    """Each step: request the missing groups, wait for every response, filter, repeat."""
    supply = groups(args, tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(256)
    total, lengths, generated, used = 0.0, [], 0, 0
    for step in range(args.steps):
        client.post("/update_weight_version", {"new_version": f"step-{step}"})
        begin, accepted = time.monotonic(), 0
        while accepted < args.prompts:
            batch = [next(supply) for _ in range(args.prompts - accepted)]
            futures = [
                [
                    pool.submit(client.generate, list(r.prompt_ids), {**sampling, "max_new_tokens": n})
                    for n in r.max_new_tokens
                ]
                for r, _ in batch
            ]
            for (_, reward), fs in zip(batch, futures):
                outs = [parse_output(f.result()[0], 0, True) for f in fs]
                lengths += [s.num_tokens for s in outs]
                generated += sum(s.num_tokens for s in outs)
                if not dynamic or len(set(reward)) > 1:
                    accepted += 1
                    used += sum(s.num_tokens for s in outs)
        total += time.monotonic() - begin
    pool.shutdown()
    return total, lengths, generated, used


def run_partial(args, client, tokenizer, sampling, dynamic):
    """The same steps through the partial generator; the buffer carries over between steps."""
    rewards = {}

    def feed():
        for request, reward in groups(args, tokenizer):
            rewards[request.key] = reward
            yield request

    accept = (lambda request, members: len(set(rewards[request.key])) > 1) if dynamic else None
    buffer = PartialBuffer(max_versions=args.max_versions, on_stale="finish")
    gen = PartialGenerator(client, sampling, buffer, over_provision=args.over_provision)
    supply = feed()
    total, lengths, generated, used, most = 0.0, [], 0, 0, 1
    for step in range(args.steps):
        client.post("/update_weight_version", {"new_version": f"step-{step}"})
        done, metrics = gen.generate(supply, args.prompts, f"step-{step}", accept=accept)
        total += metrics["time/generation"]
        generated += int(metrics["partial/generated_tokens"])
        for _, members in done:
            lengths += [m.sample.num_tokens for m in members]
            used += sum(m.sample.num_tokens for m in members)
        most = max(most, int(metrics.get("partial/versions_spanned_max", 1)))
    gen.close()
    return total, lengths, generated, used, most, buffer.counts["dropped_tokens"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="groups per step")
    parser.add_argument("--group", type=int, default=4, help="G")
    parser.add_argument("--median", type=int, default=16, help="median natural response length (tokens)")
    parser.add_argument("--seconds-per-token", type=float, default=0.05)
    parser.add_argument("--over-provision", type=float, default=2.0)
    parser.add_argument("--max-versions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.max_len = 3 * args.median
    sampling = {"temperature": 1.0, "ignore_eos": True}  # the natural length is the request's max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        _, tokenizer = make_tiny_checkpoint(tmp, seed=0, sharpen=8.0)
        engine = LocalEngine.from_pretrained(tmp, weight_version="step-0")
        with SGLangTestServer(engine, model_path=tmp, seconds_per_token=args.seconds_per_token) as server:
            client = SGLangClient(server.url, request_timeout=600)
            ratios, line = [], {}
            for dynamic in (False, True):
                off_t, off_len, off_gen, off_used = run_off(args, client, tokenizer, sampling, dynamic)
                par_t, _, par_gen, par_used, most, wasted = run_partial(args, client, tokenizer, sampling, dynamic)
                ratio = par_t / off_t
                ratios.append(ratio)
                name = "with dynamic sampling" if dynamic else "without dynamic sampling"
                print(
                    f"{name}: off {off_t:.2f}s ({off_gen} tokens generated, {off_used} in accepted groups); "
                    f"partial {par_t:.2f}s ({par_gen} generated, {par_used} in accepted groups, {wasted} wasted); "
                    f"ratio {ratio:.3f}; versions spanned at most {most}",
                    flush=True,
                )
                line = {
                    "wasted_token_frac_off": 0.0,  # off never aborts: every response it starts, it finishes
                    "wasted_token_frac_partial": max(line.get("wasted_token_frac_partial", 0.0), wasted / par_gen),
                    "max_versions_spanned": max(line.get("max_versions_spanned", 1), most),
                    "length_p99_over_p50": percentile(off_len, 0.99) / percentile(off_len, 0.5),
                }
    print(
        f"rollout_time_ratio_partial_vs_off={max(ratios):.3f} "
        f"wasted_token_frac_off={line['wasted_token_frac_off']:.3f} "
        f"wasted_token_frac_partial={line['wasted_token_frac_partial']:.3f} "
        f"max_versions_spanned={line['max_versions_spanned']} "
        f"length_p99_over_p50={line['length_p99_over_p50']:.2f} "
        "reward_end_off=not_measured reward_end_partial=not_measured"
    )


if __name__ == "__main__":
    main()
