"""Multi-turn ARMOR with a tool, on a laptop's CPU: a tiny model learns to call a lookup tool.

    python examples/tool_use_cpu.py [--out outputs/tool_use] [key=value ...]

1. warms a tiny Qwen2-style model up on the lookup task (``armor_megatron/tasks/tool_lookup.py``):
   the answer is a secret digit only the tool returns; a quarter of the warm-up responses call the
   tool and copy its result (``#7>`` → ``=5`` → ``\\boxed{5}``), the rest answer at once with a
   wrong guess, so the warmed-up policy calls on about a third of its samples and RL must learn
   to call always;
2. ``armor-train`` with ``configs/tiny_tool_use.yaml``: multi-turn rollouts (the environment
   ``LookupTable``, tool results masked out of the loss), verified anchors from π_ref running the
   same loop, the mixed ratio;
3. prints, per step, the training reward and the tool use of the step's responses (calls per
   response, share calling with the prompt's key, share answering without a call), and the
   validation accuracy of the greedy policy.

The last line is ``reward_start=… reward_end=… calls_start=… calls_end=… correct_call_start=…
correct_call_end=… val_start=… val_end=… minutes=… cpu_minutes=…`` (start: the mean of the first 3
steps, end: of the last 3; val: the first and last evaluation; minutes: wall clock; cpu_minutes:
CPU time of the example and its trainer).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

from armor_megatron.config import load_config
from armor_megatron.tasks.tiny_run import prepare_tiny_run
from armor_megatron.trainer.metrics_log import read_metrics

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_tool_use.yaml")


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the trainer)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tool_use", help="working directory of the run")
    parser.add_argument("--warmup-steps", type=int, default=800, help="supervised warm-up steps")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides")
    args = parser.parse_args()
    started = time.time()
    out = os.path.abspath(args.out)
    paths = [
        f"model.path={out}/hf",
        f"data.train_path={out}/train.jsonl",
        f"eval.datasets=[{{name: lookup-val, path: {out}/val.jsonl, k: 1}}]",
        f"checkpoint.dir={out}/checkpoints",
        f"logging.dir={out}/runs",
        *args.overrides,
    ]
    cfg = load_config(CONFIG, paths)
    print(f"[tool-use] warming up the tiny model in {out}", flush=True)
    prepare_tiny_run(
        cfg, task="tool_lookup", num_val=64, warmup_steps=args.warmup_steps, log=lambda m: print(f"[tool-use] {m}")
    )
    metrics_path = os.path.join(cfg.logging.dir, cfg.name, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run's log
    print("[tool-use] training", flush=True)
    cmd = [sys.executable, "-m", "armor_megatron.cli.train", "--config", CONFIG, *paths, "checkpoint.resume=none"]
    code = subprocess.call(cmd)
    if code:
        return code
    records = {r["step"]: r for r in read_metrics(metrics_path)}
    steps = sorted(s for s in records if s > 0)
    print(f"\n{'step':>4}  {'reward':>6}  {'calls':>5}  {'correct call':>12}  {'no call':>7}  {'val acc':>7}")
    for s in steps:
        r = records[s]
        val = r.get("eval/lookup-val/avg@1")
        print(
            f"{s:>4}  {r['rollout/on_policy_accuracy']:>6.3f}  {r['rollout/tool_calls']:>5.2f}  "
            f"{r['rollout/tool_correct_share']:>12.3f}  {r['rollout/tool_direct_share']:>7.3f}  "
            + (f"{val:>7.3f}" if val is not None else f"{'':>7}")
        )

    def mean(key: str, chosen: list[int]) -> float:
        return sum(records[s][key] for s in chosen) / len(chosen)

    first, last = steps[:3], steps[-3:]
    evals = [s for s in sorted(records) if "eval/lookup-val/avg@1" in records[s]]
    print(
        f"reward_start={mean('rollout/on_policy_accuracy', first):.4f} "
        f"reward_end={mean('rollout/on_policy_accuracy', last):.4f} "
        f"calls_start={mean('rollout/tool_calls', first):.4f} "
        f"calls_end={mean('rollout/tool_calls', last):.4f} "
        f"correct_call_start={mean('rollout/tool_correct_share', first):.4f} "
        f"correct_call_end={mean('rollout/tool_correct_share', last):.4f} "
        f"val_start={records[evals[0]]['eval/lookup-val/avg@1']:.4f} "
        f"val_end={records[evals[-1]]['eval/lookup-val/avg@1']:.4f} "
        f"minutes={(time.time() - started) / 60:.2f}"
        f" cpu_minutes={cpu_seconds() / 60:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
