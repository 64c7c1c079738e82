"""The main job: a complete tiny ARMOR run on CPU, next to a DAPO baseline.

    python examples/tiny_cpu.py [--config configs/tiny_cpu.yaml] [--out outputs/tiny] [key=value ...]

1. builds a tiny Qwen2-style model and a local tokenizer, and warms it up with supervised steps
   on synthetic arithmetic so the reference policy solves part of it;
2. ``armor-train``: converts it to a Megatron checkpoint and trains with ARMOR (Megatron actor
   and reference at TP=2 over gloo, the local rollout engine, verified anchors, the mixed
   ratio, reference resets);
3. ``armor-train`` again with anchors off and α = 1: the DAPO baseline from the same start;
4. prints validation accuracy (greedy pass@1 on held-out problems) over the steps of both runs.

The last line is ``val_acc_start=… armor_val_acc_end=… dapo_val_acc_end=… minutes=…``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAL_METRIC = "eval/mean/pass@1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    parser.add_argument("--out", default="outputs/tiny", help="working directory of the run")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for both runs")
    args = parser.parse_args()
    started = time.time()

    from armor_megatron.config import load_config
    from armor_megatron.tasks.tiny_run import prepare_tiny_run

    out = os.path.abspath(args.out)
    paths = [
        f"model.path={out}/hf",
        f"data.train_path={out}/train.jsonl",
        f"eval.datasets=[{{name: arith-val, path: {out}/val.jsonl, k: 1}}]",
        f"logging.dir={out}/runs",
    ]
    cfg = load_config(args.config, paths + args.overrides)
    print(f"[tiny] preparing the tiny model and data in {out}", flush=True)
    prepare_tiny_run(cfg, log=lambda m: print(f"[tiny] {m}", flush=True))

    runs = {
        "armor": [f"checkpoint.dir={out}/ckpt-armor", "name=armor"],
        "dapo": [f"checkpoint.dir={out}/ckpt-dapo", "name=dapo", "anchor.enabled=false", "algorithm.alpha=1.0"],
    }
    history = {}
    for name, extra in runs.items():
        print(f"[tiny] training {name} ...", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "armor_megatron.cli.train",
            "--config",
            args.config,
            *paths,
            *args.overrides,
            *extra,
            "checkpoint.resume=none",
        ]
        code = subprocess.call(cmd)
        if code:
            print(f"[tiny] {name} run failed with exit code {code}", file=sys.stderr)
            return code
        history[name] = _read(os.path.join(out, "runs", name, "metrics.jsonl"))

    steps = sorted(set(history["armor"]) | set(history["dapo"]))
    print()
    print(
        f"{'step':>5}  {'ARMOR val acc':>13}  {'DAPO val acc':>12}  {'ARMOR train acc':>15}  {'DAPO train acc':>14}  {'anchors found':>13}"
    )
    for step in steps:
        a, d = history["armor"].get(step, {}), history["dapo"].get(step, {})
        if VAL_METRIC not in a and VAL_METRIC not in d:
            continue
        print(
            f"{step:>5}  {_fmt(a, VAL_METRIC):>13}  {_fmt(d, VAL_METRIC):>12}  {_fmt(a, 'rollout/on_policy_accuracy'):>15}  "
            f"{_fmt(d, 'rollout/on_policy_accuracy'):>14}  {_fmt(a, 'anchor/found_rate'):>13}"
        )
    start = history["armor"][0][VAL_METRIC]
    armor_end = _last(history["armor"], VAL_METRIC)
    dapo_end = _last(history["dapo"], VAL_METRIC)
    minutes = (time.time() - started) / 60
    print(
        f"val_acc_start={start:.4f} armor_val_acc_end={armor_end:.4f} dapo_val_acc_end={dapo_end:.4f} minutes={minutes:.2f}"
    )
    return 0


def _read(path: str) -> dict[int, dict]:
    from armor_megatron.trainer.metrics_log import read_metrics

    return {r["step"]: r for r in read_metrics(path)}


def _last(history: dict[int, dict], key: str) -> float:
    return [r[key] for _, r in sorted(history.items()) if key in r][-1]


def _fmt(record: dict, key: str) -> str:
    return f"{record[key]:.3f}" if key in record else "-"


if __name__ == "__main__":
    sys.exit(main())
