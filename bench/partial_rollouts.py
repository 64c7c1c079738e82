"""Rollout time of partial rollouts (over-provision, abort, continue) against waiting for every response.

Setup: the SGLang test double (a tiny Qwen2 on CPU) with a per-token decode time
(``--seconds-per-token``, default 0.5 s: the double's own sampling, one sequence after another,
has to keep ahead of its decode clock on two shared cores), so a response's time is its length, and a running
batch bounded as SGLang's ``--max-running-requests`` bounds it (``--max-running-requests``,
default P·G, the sequences one step needs: what the off path runs at once, so every sequence
partial rollouts over-provision waits in the queue for a slot; 0: unbounded). A decode step
advances every running sequence by one token and its time does not grow with the batch.
Response lengths are long-tailed: each response's natural length is drawn from a lognormal with
median ``--median`` tokens and σ = 0.47 (p99/p50 = e^(2.326σ) = 2.98 before truncation),
truncated at the maximum length 3 × median (P(L > 3·median) = P(Z > ln 3 / σ) ≈ 1%; truncated
responses are included). Rewards are drawn per response from a per-prompt success rate (the
same for both modes), so dynamic sampling drops the groups whose rewards are all equal.

Both modes see the same prompts, lengths and rewards, step after step (the policy version
changes each step, as after an update; no training happens in this part):

* off ......... each step requests the groups it needs and waits for all their responses;
                with dynamic sampling, refill rounds request the missing groups and wait again;
* partial ..... `armor_megatron.rollout.partial_generation.PartialGenerator`: over-provision
                ``--over-provision`` × the groups, accept groups as they complete (dynamic
                sampling's filter as they finish, refilled at once), abort the rest once enough
                are accepted and continue them first in the next step (staleness rule finish,
                at most ``--max-versions`` versions per response).

The first line prints ``--plan``'s steady-state prediction for these lengths and this batch
(:mod:`armor_megatron.launch.partial_gain`); off's lines print its decode clock alone (per round,
the longest response × seconds per token): what off would take if the double's sampling cost
nothing, so the excess over it is CPU time, which a loaded machine adds to both modes.

wasted tokens = generated tokens neither in an accepted group nor kept for a later step
(tokens of groups dynamic sampling drops are counted apart: both modes drop the same share).

The reward curve (``--train-seeds N`` > 0): ``armor-train`` on the tiny arithmetic task
(configs/tiny_cpu.yaml, the warmed-up tiny model the tests build) against the double with
``--train-seconds-per-token`` (fast: the runs are about learning, not timing), rollout.partial
on and off, N seeds each (train.seed = rollout.seed = the double's seed), anchors and dynamic
sampling off. reward_end_* = the mean ``rollout/reward`` of the last ``--train-tail`` steps,
averaged over seeds, ± the spread (sample standard deviation) of the seeds' means.

The last line: ``rollout_time_ratio_partial_vs_off= wasted_token_frac_off= wasted_token_frac_partial=
max_versions_spanned= length_p99_over_p50= reward_end_off= reward_end_partial=``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout too
from armor_megatron.config import load_config  # noqa: E402
from armor_megatron.launch.partial_gain import LengthDistribution, partial_generation_ratio  # noqa: E402
from armor_megatron.rollout.local import LocalEngine  # noqa: E402
from armor_megatron.rollout.partial import PartialBuffer  # noqa: E402
from armor_megatron.rollout.partial_generation import GroupRequest, PartialGenerator, percentile  # noqa: E402
from armor_megatron.rollout.sglang.client import SGLangClient, parse_output  # noqa: E402
from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher  # noqa: E402
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer  # noqa: E402
from armor_megatron.rollout.testing.tiny_models import encode, make_tiny_checkpoint  # noqa: E402
from armor_megatron.tasks.tiny_run import prepare_tiny_run  # noqa: E402
from armor_megatron.trainer.metrics_log import read_metrics  # noqa: E402

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


def bench_lengths(args):
    """The exact distribution of the lengths :func:`groups` draws: round(median·e^(σZ)) within [1, max_len]."""

    def cdf(x):
        k = math.floor(x)
        if k < 1:
            return 0.0
        return 0.5 * (1.0 + math.erf(math.log((k + 0.5) / args.median) / (SIGMA * math.sqrt(2.0))))

    return LengthDistribution(cdf, args.max_len)


def run_off(args, client, tokenizer, sampling, dynamic):
    """Each step: request the missing groups, wait for every response, filter, repeat."""
    supply = groups(args, tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(256)
    total, lengths, generated, used, clock = 0.0, [], 0, 0, 0.0
    for step in range(args.steps):
        client.post("/update_weight_version", {"new_version": f"step-{step}"})
        begin, accepted = time.monotonic(), 0
        while accepted < args.prompts:
            batch = [next(supply) for _ in range(args.prompts - accepted)]
            clock += max(n for r, _ in batch for n in r.max_new_tokens) * args.seconds_per_token
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
    return total, lengths, generated, used, clock


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


def train_rewards(args, tmp, seed, partial):
    """``rollout/reward`` per step of one ``armor-train`` run against a fresh double."""
    config = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    data = os.path.join(args.train_dir or tmp, "tiny")
    paths = [f"model.path={data}/hf", f"data.train_path={data}/train.jsonl", "eval.datasets=[]"]
    run = os.path.join(tmp, f"{'partial' if partial else 'off'}-{seed}")
    extra = ["--seconds-per-token", str(args.train_seconds_per_token), "--seed", str(seed)]
    if args.max_running_requests:
        extra += ["--max-running-requests", str(args.train_prompts * args.train_group)]
    launcher = SGLangLauncher(
        LauncherConfig(
            model_path=f"{data}/hf",
            num_engines=1,
            colocated=True,
            server_module="armor_megatron.rollout.testing.sglang_test_server",
            extra_args=extra,
            log_dir=os.path.join(run, "engine"),
            startup_timeout=300,
        )
    ).start()
    try:
        overrides = [
            *paths,
            "parallelism.tp=1",
            "rollout.engine=sglang",
            f"rollout.sglang.urls=[{launcher.worker_urls[0]}]",
            "rollout.sglang.weight_sync=disk",
            "rollout.sglang.placement=colocated",
            "anchor.enabled=false",
            f"rollout.partial.enabled={str(partial).lower()}",
            f"rollout.partial.over_provision={args.over_provision}",
            f"rollout.partial.max_versions={args.max_versions}",
            f"rollout.prompts_per_step={args.train_prompts}",
            f"rollout.group_size={args.train_group}",
            "algorithm.dynamic_sampling.enabled=false",
            "algorithm.tis.enabled=true",
            f"optimizer.lr={args.train_lr}",
            f"train.steps={args.train_steps}",
            f"train.micro_batch_size={args.train_prompts}",
            f"train.seed={seed}",
            f"rollout.seed={seed}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            f"checkpoint.dir={run}/ckpt",
            f"logging.dir={run}/runs",
            "name=run",
        ]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "armor_megatron.cli.train", "--config", config, *overrides]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"armor-train failed ({proc.returncode}): {proc.stderr[-3000:]}")
    finally:
        launcher.stop()
    records = read_metrics(os.path.join(run, "runs", "run", "metrics.jsonl"))
    return [r["rollout/reward"] for r in sorted(records, key=lambda r: r["step"]) if "rollout/reward" in r]


def reward_curves(args):
    """Per mode, per seed: the reward per step of the tiny task's training runs."""
    curves = {"off": {}, "partial": {}}
    if args.train_dir:
        os.makedirs(args.train_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.train_dir) as tmp:
        data = os.path.join(args.train_dir or tmp, "tiny")  # the warmed-up model is kept there, reused
        paths = [
            f"model.path={data}/hf",
            f"data.train_path={data}/train.jsonl",
            f"eval.datasets=[{{name: val, path: {data}/val.jsonl, k: 1}}]",
        ]
        prepare_tiny_run(
            load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), paths), num_val=16, warmup_steps=150, log=None
        )
        for seed in range(args.train_seeds):
            for mode in ("off", "partial"):
                curve = train_rewards(args, tmp, seed, mode == "partial")
                curves[mode][seed] = curve
                tail = curve[-args.train_tail :]
                print(
                    f"reward {mode} seed {seed}: first {args.train_tail} steps {statistics.fmean(curve[: args.train_tail]):.4f}, "
                    f"last {args.train_tail} steps {statistics.fmean(tail):.4f}; per step "
                    + " ".join(f"{r:.3f}" for r in curve),
                    flush=True,
                )
    return curves


def tail_mean(args, curves):
    """``mean±spread`` of the seeds' last-steps mean reward (spread: sample std over seeds)."""
    means = [statistics.fmean(c[-args.train_tail :]) for c in curves.values()]
    spread = statistics.stdev(means) if len(means) > 1 else 0.0
    return f"{statistics.fmean(means):.4f}±{spread:.4f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="groups per step")
    parser.add_argument("--group", type=int, default=4, help="G")
    parser.add_argument("--median", type=int, default=16, help="median natural response length (tokens)")
    parser.add_argument("--seconds-per-token", type=float, default=0.5)
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="the double's running batch (default: prompts × group; 0: unbounded)",
    )
    parser.add_argument("--over-provision", type=float, default=2.0)
    parser.add_argument("--max-versions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-seeds", type=int, default=0, help="armor-train runs per mode (0: reward not measured)")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--train-tail", type=int, default=10, help="steps the end reward is the mean of")
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--train-group", type=int, default=8)
    parser.add_argument("--train-lr", type=float, default=5e-4)
    parser.add_argument("--train-seconds-per-token", type=float, default=0.002)
    parser.add_argument(
        "--train-dir", default=None, help="keeps the warmed-up tiny model between runs (default: a temporary one)"
    )
    parser.add_argument("--skip-timing", action="store_true", help="only the reward curves")
    args = parser.parse_args(argv)
    if args.max_running_requests is None:
        args.max_running_requests = args.prompts * args.group
    args.max_len = 3 * args.median
    ratios, line = [], {}
    if not args.skip_timing:
        ratios, line = timing(args)
    rewards = {"reward_end_off": "not_measured", "reward_end_partial": "not_measured"}
    if args.train_seeds:
        curves = reward_curves(args)
        rewards = {f"reward_end_{mode}": tail_mean(args, c) for mode, c in curves.items()}
    timed = (
        f"rollout_time_ratio_partial_vs_off={max(ratios):.3f} "
        f"wasted_token_frac_off={line['wasted_token_frac_off']:.3f} "
        f"wasted_token_frac_partial={line['wasted_token_frac_partial']:.3f} "
        f"max_versions_spanned={line['max_versions_spanned']} "
        f"length_p99_over_p50={line['length_p99_over_p50']:.2f} "
        if ratios
        else ""
    )
    print(timed + " ".join(f"{k}={v}" for k, v in rewards.items()))


def timing(args):
    """Rollout time of both modes, with and without dynamic sampling; the printed line's figures."""
    sampling = {"temperature": 1.0, "ignore_eos": True}  # the natural length is the request's max_new_tokens
    torch.set_num_threads(1)  # the double's sampling has to keep ahead of its decode clock: least contention
    bound = args.max_running_requests or None
    n = args.prompts * args.group
    predicted = partial_generation_ratio(bench_lengths(args), n, bound) if bound and bound >= n else None
    print(
        f"running batch: {bound or 'unbounded'} sequences; {args.prompts} groups of {args.group} per step"
        + (f"; --plan's steady-state model predicts {predicted:.3f} without dynamic sampling" if predicted else ""),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        _, tokenizer = make_tiny_checkpoint(tmp, seed=0, sharpen=8.0)
        engine = LocalEngine.from_pretrained(tmp, weight_version="step-0")
        with SGLangTestServer(
            engine, model_path=tmp, seconds_per_token=args.seconds_per_token, max_running_requests=bound
        ) as server:
            client = SGLangClient(server.url, request_timeout=600)
            ratios, line = [], {}
            for dynamic in (False, True):
                off_t, off_len, off_gen, off_used, clock = run_off(args, client, tokenizer, sampling, dynamic)
                par_t, _, par_gen, par_used, most, wasted = run_partial(args, client, tokenizer, sampling, dynamic)
                ratio = par_t / off_t
                ratios.append(ratio)
                name = "with dynamic sampling" if dynamic else "without dynamic sampling"
                print(
                    f"{name}: off {off_t:.2f}s (its decode clock alone {clock:.2f}s; {off_gen} tokens generated, "
                    f"{off_used} in accepted groups); "
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
    return ratios, line


if __name__ == "__main__":
    main()
