"""Check 2: ``armor-train`` for 3 steps on one device, with a checkpoint, a resume and a reference reset.

    python tools/gpu_check/check_train.py --work DIR [--device cuda|cpu] [--json PATH] [key=value ...]
    python tools/gpu_check/check_train.py --work DIR --prepare [--warmup-steps 150]   # the tiny model only

Runs the package's own entry point (``python -m armor_megatron.cli.train``, what ``armor-train``
is) with ``configs/gpu_check.yaml`` on the tiny model that `prepare` writes (tiny_run.py:
the tiny_cpu model warmed up on synthetic arithmetic, so π_ref finds some anchors):

1. steps 1-2 from the converted HF model: anchors, the mixed ratio, θ_ref ← θ at step 2
   (τ = 2), a checkpoint at step 2;
2. a second process with ``checkpoint.resume=auto``: loads step 2 and trains step 3.

It passes when steps 1, 2, 3 trained (tokens, no skipped update, finite loss, anchor metrics),
the reset happened at step 2, the second process resumed at step 2 and saved step 3, the
engine's log-probs are within the parity check's bf16 bound of the trainer's
(``rollout/logprob_abs_diff``) at the config's T = 0.7, truncated importance sampling weighted
the on-policy tokens by about 1 (``train/tis_weight_mean`` within that bound of 1: both sides
at the same temperature), and at step 3 π_ref is π_θ again (``train/approx_kl_ref`` at
most 1e-6 above ten times step 1's, when both started from one checkpoint): the reset and
its checkpoint round trip kept the reference.

The trainer picks its device itself (CUDA whenever torch sees one, megatron/dist.py); the local
rollout engine runs where ``rollout.local_device`` says: the GPU with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import ROOT, exit_on_sigterm, free_port, report, run_process_group, select_device  # noqa: E402
from check_parity import BF16_MEAN_ABS  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "gpu_check.yaml")
KL_FLOOR = 1e-6
TIS_MEAN_BOUND = 2 * BF16_MEAN_ABS  # mean of exp(lp_old - lp_engine) when the mean |gap| is within BF16_MEAN_ABS


def tiny_paths(work: str) -> list[str]:
    """Overrides that point the config at the tiny model and data under `work`."""
    return [f"model.path={work}/hf", f"data.train_path={work}/train.jsonl"]


def prepare(work: str, warmup_steps: int, config: str = CONFIG, log=print) -> str:
    """Write the warmed-up tiny HF model and its data under `work` (kept when present); returns the HF dir."""
    from armor_megatron.config import load_config
    from armor_megatron.tasks.tiny_run import prepare_tiny_run

    prepare_tiny_run(load_config(config, tiny_paths(work)), num_val=16, warmup_steps=warmup_steps, log=log)
    return os.path.join(work, "hf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="directory holding hf/ and train.jsonl (see prepare)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each armor-train process")
    p.add_argument("--prepare", action="store_true", help="only write the tiny model and data (see prepare)")
    p.add_argument("--warmup-steps", type=int, default=150, help="--prepare: supervised warm-up steps")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for both processes")
    return p.parse_args(argv)


def armor_train(args, run_dir: str, *overrides: str) -> tuple[int, str]:
    """One ``armor-train`` process; returns (exit code, its output). Its output is echoed to ours."""
    cmd = [
        sys.executable,
        "-m",
        "armor_megatron.cli.train",
        "--config",
        args.config,
        *tiny_paths(args.work),
        f"checkpoint.dir={run_dir}/ckpt",
        f"logging.dir={run_dir}/runs",
        *(["launch.gpus_per_node=0"] if args.device == "cpu" else ["rollout.local_device=cuda"]),
        *args.overrides,
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    print("$ " + " ".join(cmd), flush=True)
    with tempfile.TemporaryFile("w+") as out:
        code = run_process_group(cmd, args.timeout, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        out.seek(0)
        text = out.read()
    print(text, flush=True)
    if code is None:
        return 124, text + f"\narmor-train timed out after {args.timeout:.0f} s"
    return code, text


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def problems(metrics: dict, resumed_output: str, latest: str | None) -> list[str]:
    """What is wrong with the three steps' metrics ({step: record}) and the resume; [] when all is well."""
    found = []
    missing = [s for s in (1, 2, 3) if s not in metrics]
    if missing:
        return [f"no metrics for steps {missing}"]
    for step in (1, 2, 3):
        m = metrics[step]
        if not m.get("train/num_tokens", 0) > 0 or m.get("train/skipped", 1.0) != 0.0:
            found.append(
                f"step {step} did not update (num_tokens {m.get('train/num_tokens')}, skipped {m.get('train/skipped')})"
            )
        if not math.isfinite(m.get("train/loss", math.nan)):
            found.append(f"step {step} loss {m.get('train/loss')}")
        if "anchor/found_rate" not in m:
            found.append(f"step {step} has no anchor metrics")
        if not m.get("rollout/logprob_abs_diff", math.inf) <= BF16_MEAN_ABS:
            found.append(
                f"step {step} engine/trainer log-prob gap {m.get('rollout/logprob_abs_diff')} > {BF16_MEAN_ABS}"
            )
        if not abs(m.get("train/tis_weight_mean", math.inf) - 1.0) <= TIS_MEAN_BOUND:
            found.append(
                f"step {step} TIS weight mean {m.get('train/tis_weight_mean')} not within {TIS_MEAN_BOUND} of 1"
            )
    if metrics[2].get("reference/reset") != 1.0:
        found.append("no reference reset at step 2")
    if "resumed from" not in resumed_output or "at step 2" not in resumed_output:
        found.append("the second process did not resume at step 2")
    if latest != "iter_0000003":
        found.append(f"latest checkpoint is {latest}, not iter_0000003")
    kl1, kl3 = metrics[1].get("train/approx_kl_ref", math.nan), metrics[3].get("train/approx_kl_ref", math.nan)
    if not abs(kl3) <= KL_FLOOR + 10 * abs(kl1):
        found.append(f"π_ref != π_θ after the reset and resume: approx_kl_ref {kl3:.3g} at step 3, {kl1:.3g} at step 1")
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    select_device(args.device)
    exit_on_sigterm()
    started = time.perf_counter()
    if args.prepare:
        hf = prepare(args.work, args.warmup_steps, args.config, log=lambda m: print(f"[prepare] {m}", flush=True))
        line = f"tiny model in {hf} ({args.warmup_steps} warm-up steps), {time.perf_counter() - started:.0f} s"
        report(args.json, "prepare", True, line)
        return 0
    from armor_megatron.trainer.metrics_log import read_metrics

    run_dir = os.path.join(args.work, "train_run")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no checkpoint or metrics of an earlier one
    code, out = armor_train(args, run_dir, "train.steps=2", "checkpoint.resume=none")
    resumed = ""
    if code == 0:
        code, resumed = armor_train(args, run_dir, "train.steps=3", "checkpoint.resume=auto")
    seconds = time.perf_counter() - started
    where = f"{args.device}/{'nccl' if args.device == 'cuda' else 'gloo'}"
    if code != 0:
        report(args.json, "train", False, f"armor-train on {where} exited {code}: {last_line(resumed or out)}")
        return 1
    path = os.path.join(run_dir, "runs", "gpu-check", "metrics.jsonl")
    metrics = {r["step"]: r for r in read_metrics(path)}
    latest_file = os.path.join(run_dir, "ckpt", "latest")
    latest = open(latest_file).read().strip() if os.path.exists(latest_file) else None
    wrong = problems(metrics, resumed, latest)
    m = {s: metrics.get(s, {}) for s in (1, 2, 3)}
    gap = max(m[s].get("rollout/logprob_abs_diff", math.nan) for s in (1, 2, 3))
    line = (
        f"armor-train 3 steps on {where} (bf16, local spec, local engine on {args.device}): steps 1-2, reset at 2, "
        f"checkpoint, resume at 2 -> step 3; anchors found {_rates(m, 'anchor/found_rate')}, "
        f"accuracy {_rates(m, 'rollout/on_policy_accuracy')}, engine-trainer mean|d| <= {gap:.2e} at T=0.7, "
        f"TIS weight means {_rates(m, 'train/tis_weight_mean')}, "
        f"kl_ref@3={m[3].get('train/approx_kl_ref', math.nan):.1e}, {seconds:.0f} s"
        + (f"; FAILED: {'; '.join(wrong)}" if wrong else "")
    )
    report(args.json, "train", not wrong, line, metrics={str(s): r for s, r in m.items()}, seconds=seconds)
    return 0 if not wrong else 1


def _rates(m: dict, key: str) -> str:
    return "/".join(f"{m[s][key]:.2f}" if key in m[s] else "-" for s in (1, 2, 3))


if __name__ == "__main__":
    sys.exit(main())
