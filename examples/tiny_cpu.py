"""The main job: ARMOR next to DAPO on a task that over-optimises, on a laptop's CPU.

    python examples/tiny_cpu.py [--out outputs/tiny] [--jobs N] [key=value ...]

1. warms a tiny Qwen2-style model up on tagged addition (``armor_megatron/tasks/tagged_addition.py``):
   problems whose RL training set leaks the answer's last digit in a tag that validation
   problems do not carry, so training reward can rise while validation accuracy falls;
2. ``armor-train`` twice from that model, side by side: ARMOR (Megatron actor and reference,
   the local rollout engine, verified anchors, the mixed ratio, reference resets) and DAPO
   (anchors off, α = 1), seed 1 of the study in ``examples/overopt_study.py``;
3. writes ``<out>/curves.png`` (validation accuracy and training reward over the steps) and
   prints the table.

The last line is ``val_acc_start=… armor_val_acc_end=… dapo_val_acc_end=… dapo_val_peak=… minutes=…``.
About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys

from armor_megatron.trainer.study import run_study


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tiny", help="working directory of the run")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: one per CPU)")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for both runs")
    args = parser.parse_args()
    result = run_study(
        args.out,
        ["dapo", "armor"],
        [1],
        overrides=args.overrides,
        jobs=args.jobs,
        log=lambda m: print(f"[tiny] {m}", flush=True),
    )
    dapo, armor = result.curves["dapo"], result.curves["armor"]
    print()
    print(
        f"{'step':>5}  {'ARMOR val acc':>13}  {'DAPO val acc':>12}  {'ARMOR train reward':>18}  {'DAPO train reward':>17}"
    )
    for i, step in enumerate(dapo.steps):
        j = armor.steps.index(step) if step in armor.steps else None
        a_val, a_train = (armor.val_mean[j], armor.train_mean[j]) if j is not None else (float("nan"),) * 2
        print(f"{step:>5}  {a_val:>13.3f}  {dapo.val_mean[i]:>12.3f}  {a_train:>18.3f}  {dapo.train_mean[i]:>17.3f}")
    print()
    print(result.table)
    print(f"\ncurves: {result.png}")
    print(
        f"val_acc_start={dapo.start:.4f} armor_val_acc_end={armor.end:.4f} dapo_val_acc_end={dapo.end:.4f} "
        f"dapo_val_peak={dapo.peak:.4f} minutes={result.minutes:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
