"""The third over-optimisation design (a rare, noisy cue): warm-ups, the V0 gate, and pilot or study runs.

    python examples/overopt_noisy.py --seeds 101,102 [--design rare_cue|dormant] [--variants dapo,...]
                                     [--v0-only] [--force] [--out DIR] [--warmup-dir DIR] [--jobs N]
                                     [--q Q] [--copy-prob P] [--warm-right R] [--warmup-steps N]
                                     [key=value ...]

Per seed: a warm-up (``armor_megatron/tasks/noisy_cue.py``), the V0 probe of π_ref on the RL training
prompts (``armor_megatron/tasks/v0_gate.py``; one line per seed), then the variants on the seeds that
pass V0 (all with ``--force``; none with ``--v0-only``). Prints per run: validation accuracy at the
start, its peak (step) and end, the shortcut's share among validation and rollout responses, the
worked mode's validation accuracy; then wall and CPU minutes. Pilots use seeds the study never uses
(101 and up) and are disclosed in ``examples/overopt_pilots.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from armor_megatron.study.noisy import NOISY_SPLIT, NOISY_TASK, NOISY_VARIANTS, run_noisy
from armor_megatron.tasks.overopt_checks import summarize_run
from armor_megatron.trainer.metrics_log import read_metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", required=True, type=lambda t: [int(s) for s in t.split(",") if s])
    parser.add_argument("--design", choices=("rare_cue", "dormant"), default=NOISY_SPLIT["design"])
    parser.add_argument("--variants", default="dapo", help="comma list of " + ",".join(NOISY_VARIANTS))
    parser.add_argument("--v0-only", action="store_true", help="warm-ups and V0 only, no RL")
    parser.add_argument("--force", action="store_true", help="run RL on seeds that fail V0 too")
    parser.add_argument("--out", default="outputs/overopt_noisy")
    parser.add_argument("--warmup-dir", default=None)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--q", type=float, default=NOISY_SPLIT["q"], help="share of right tags in RL rows")
    parser.add_argument("--copy-prob", type=float, default=NOISY_SPLIT["copy_prob"], help="copy rows in warm-up")
    parser.add_argument("--warm-right", type=float, default=NOISY_SPLIT["warm_right"], help="right tags in W rows")
    parser.add_argument("--warmup-steps", type=int, default=NOISY_TASK["warmup_steps"], help="warm-up steps")
    parser.add_argument("--max-operand", type=int, default=NOISY_TASK["max_operand"], help="operands in [0, N]")
    parser.add_argument("--rl-pairs", type=int, default=NOISY_SPLIT["rl_pairs"], help="pairs kept from warm-up")
    parser.add_argument("--copy-drills", type=int, default=NOISY_SPLIT["copy_drills"], help="copy-drill rows")
    parser.add_argument("--w-slip", type=float, default=NOISY_SPLIT["w_slip"], help="slipped worked warm-up rows")
    parser.add_argument("--mix-commits", action="store_true", help="allow runs of another commit in --out")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = parser.parse_args()
    variants = [] if args.v0_only else [v for v in args.variants.split(",") if v]
    split = {"design": args.design, "q": args.q, "copy_prob": args.copy_prob, "warm_right": args.warm_right}
    split.update(rl_pairs=args.rl_pairs, copy_drills=args.copy_drills, w_slip=args.w_slip)
    result = run_noisy(
        args.out,
        variants,
        args.seeds,
        split=split,
        task={**NOISY_TASK, "warmup_steps": args.warmup_steps, "max_operand": args.max_operand},
        overrides=args.overrides,
        jobs=args.jobs,
        warmup_dir=args.warmup_dir,
        force=args.force,
        mix_commits=args.mix_commits,
        log=lambda m: print(f"[noisy] {m}", flush=True),
    )
    print()
    for s, v0 in result.v0.items():
        print(f"seed {s}: {v0.line()}")
    for v in variants:
        for s in result.ran:
            r = summarize_run(
                read_metrics(os.path.join(args.out, "runs", f"{v}-s{s}", "metrics.jsonl")), shortcut_share="short_share"
            )
            peak = max(range(len(r.val)), key=lambda i: (r.val[i], -i))
            roll = r.rollout_d_share[-1][1] if r.rollout_d_share else math.nan
            print(
                f"{v} seed {s}: val {r.start:.3f} peak {r.val[peak]:.3f} (step {r.steps[peak]}) last {r.val[-1]:.3f} "
                f"(step {r.steps[-1]}); val short-share {r.val_d_share[0]:.3f} -> {r.val_d_share[-1]:.3f}; "
                f"rollout short-share last {roll:.3f}; W acc {r.val_acc_w[0]:.3f} -> {r.val_acc_w[-1]:.3f}"
            )
    print(f"wall_minutes={result.minutes:.2f} cpu_minutes={result.cpu_minutes:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
