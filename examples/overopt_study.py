"""The over-optimisation study: does ARMOR keep a policy from collapsing onto a shortcut mode?

    python examples/overopt_study.py [--out outputs/overopt] [--seeds 1,...,6] [--variants dapo,armor,...]
                                     [--rho R] [--jobs N] [--warmup-dir DIR] [key=value ...]
    python examples/overopt_study.py --testbed tagged [--out outputs/overopt_tagged] [...]   # the reference control

Default testbed, worked addition (``armor_megatron/tasks/worked_addition.py``), pre-registered in
``examples/overopt_preregistration.md``: per seed one warm-up, then DAPO, ARMOR, the ablations
(mixed ratio without anchors, anchors at α = 1, ARMOR with resets) and the ρ = 0 control, paired by
seed (same warm-up, same data order). Prints the table, the validity checks M1–M5, the paired t
test of the endpoint E (mean validation accuracy over the last 40 steps), its 95 % CI and the
verdict, then wall and CPU minutes. Writes ``<out>/curves.png`` and ``<out>/summary.json``.

``--testbed tagged`` runs the earlier tagged-addition study (``armor_megatron/study/runner.py``),
whose cue anchors cannot see: the control that anchors cannot fix.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from armor_megatron.study.runner import (
    SEEDS,
    VARIANTS,
    WORKED_RHO,
    WORKED_SPLIT,
    WORKED_TASK,
    WORKED_VARIANTS,
    run_paired,
    run_study,
)
from armor_megatron.tasks.overopt_checks import decide, mean_curve
from armor_megatron.tasks.paired_test import paired_t_test

# pre-registered (examples/overopt_preregistration.md): the decision's runs (DAPO, ARMOR, the ρ = 0
# control) on seeds 1-7, first; the ablations on seeds 1-6
STUDY_SEEDS = (1, 2, 3, 4, 5, 6, 7)
ABLATION_SEEDS = (1, 2, 3, 4, 5, 6)
STUDY_ORDER = ("dapo", "armor", "dapo_no_cue", "mixed_only", "anchors_only", "armor_resets")
ABLATIONS = ("mixed_only", "anchors_only", "armor_resets")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbed", choices=("worked", "tagged"), default="worked")
    parser.add_argument("--out", default=None, help="working directory (default outputs/overopt[_tagged])")
    parser.add_argument("--variants", type=_names, default=None, help="comma list (default: every variant)")
    parser.add_argument("--seeds", type=_seeds, default=None, help="comma list of seeds")
    parser.add_argument("--rho", type=float, default=WORKED_RHO, help=f"cue share of training rows ({WORKED_RHO})")
    parser.add_argument("--d-cue", type=float, default=WORKED_SPLIT["d_cue"], help="share of hinted D warm-up rows")
    parser.add_argument("--w-prob", type=float, default=WORKED_SPLIT["w_prob"], help="W share of warm-up rows")
    parser.add_argument("--warmup-steps", type=int, default=WORKED_TASK["warmup_steps"], help="warm-up steps")
    parser.add_argument("--warmup-dir", default=None, help="where the per-seed warm-ups live (default: --out)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: one per CPU)")
    parser.add_argument(
        "--analyse-only", action="store_true", help="train nothing: analyse the runs of --out that have finished"
    )
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = parser.parse_args()
    log = lambda m: print(f"[study] {m}", flush=True)  # noqa: E731
    if args.testbed == "tagged":
        return _tagged(args, log)
    variants = args.variants or list(STUDY_ORDER)
    unknown = [v for v in variants if v not in WORKED_VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {','.join(unknown)}; known: {','.join(WORKED_VARIANTS)}")
    seeds = args.seeds or list(STUDY_SEEDS)
    ablation_seeds = [s for s in seeds if s in ABLATION_SEEDS] if args.seeds is None else seeds
    if args.analyse_only:
        return _analyse_finished(args.out or "outputs/overopt", variants, seeds, ablation_seeds)
    result = run_paired(
        args.out or "outputs/overopt",
        variants,
        seeds,
        rho=args.rho,
        overrides=args.overrides,
        jobs=args.jobs,
        warmup_dir=args.warmup_dir,
        task={**WORKED_TASK, "d_cue": args.d_cue, "w_prob": args.w_prob, "warmup_steps": args.warmup_steps},
        variant_seeds={v: ablation_seeds for v in ABLATIONS},
        log=log,
    )
    print()
    print(f"worked addition, ρ = {args.rho:g}, d_cue = {args.d_cue:g}, w_prob = {args.w_prob:g}")
    _report(result.runs, result.variant_seeds)
    print(f"\ncurves: {result.png}")
    print(f"wall_minutes={result.minutes:.2f} cpu_minutes={result.cpu_minutes:.2f} seeds={len(seeds)}")
    return 0


def _analyse_finished(out: str, variants, seeds, ablation_seeds) -> int:
    """The report over the runs in ``out`` that finished (a ``logs/<run>.done`` marker), nothing trained."""
    import os

    from armor_megatron.tasks.overopt_checks import summarize_run
    from armor_megatron.trainer.metrics_log import read_metrics

    runs, variant_seeds = {}, {}
    for v in variants:
        planned = ablation_seeds if v in ABLATIONS else seeds
        done = [s for s in planned if os.path.isfile(os.path.join(out, "logs", f"{v}-s{s}.done"))]
        if done:
            variant_seeds[v] = done
            runs[v] = [
                summarize_run(read_metrics(os.path.join(out, "runs", f"{v}-s{s}", "metrics.jsonl"))) for s in done
            ]
    if not runs:
        raise SystemExit(f"no finished run in {out}")
    print(
        f"finished runs in {out}: "
        + "; ".join(f"{v} seeds {','.join(map(str, ss))}" for v, ss in variant_seeds.items())
    )
    if "dapo" in runs and "armor" in runs and variant_seeds["dapo"] != variant_seeds["armor"]:
        common = [s for s in variant_seeds["dapo"] if s in variant_seeds["armor"]]
        for v in ("dapo", "armor"):
            runs[v] = [r for s, r in zip(variant_seeds[v], runs[v]) if s in common]
            variant_seeds[v] = common
    _report(runs, variant_seeds)
    return 0


def _report(runs: dict, variant_seeds: dict) -> None:
    """The table, the checks M1-M5, the paired test, its CI and the verdict, the ablations."""
    print("| variant | seeds | val start | val peak (step) of the mean | E (last 40 steps) ± sd | final D-share |")
    print("|---|---|---|---|---|---|")
    for v, rs in runs.items():
        c = mean_curve(rs)
        es = [r.endpoint for r in rs]
        sd = statistics.stdev(es) if len(es) > 1 else math.nan
        d = statistics.fmean(r.final_d_share for r in rs)
        print(
            f"| {WORKED_VARIANTS[v][0]} | {len(rs)} | {c.val[0]:.3f} | {c.peak:.3f} ({c.peak_step}) | "
            f"{statistics.fmean(es):.3f} ± {sd:.3f} | {d:.3f} |"
        )
    print("\nper seed E: " + "; ".join(f"{v} " + " ".join(f"{r.endpoint:.3f}" for r in rs) for v, rs in runs.items()))
    if "dapo" in runs:
        decision = decide(runs["dapo"], runs.get("armor", []), runs.get("dapo_no_cue"))
        print()
        for c in decision.checks:
            print(f"{c.name} {'PASS' if c.passed else 'FAIL'}: {c.detail}")
        t = decision.test
        if t is not None and "armor" in runs:
            print(
                f"paired t test, E_ARMOR − E_DAPO over {t.n} seeds: mean {t.mean:+.4f}, sd {t.sd:.4f}, "
                f"t = {t.t:.3f} (df {t.n - 1}), two-sided p = {t.p:.2g}, 95% CI [{t.ci_low:+.4f}, {t.ci_high:+.4f}]"
            )
        print(f"verdict: {decision.verdict} ({decision.reason})")
        dapo_by_seed = dict(zip(variant_seeds["dapo"], runs["dapo"]))
        for v in ABLATIONS:
            mine = [(s, r) for s, r in zip(variant_seeds.get(v, []), runs.get(v, [])) if s in dapo_by_seed]
            if len(mine) > 1:
                a = paired_t_test([r.endpoint for _, r in mine], [dapo_by_seed[s].endpoint for s, _ in mine])
                print(
                    f"ablation {WORKED_VARIANTS[v][0]} − DAPO: mean {a.mean:+.4f}, p = {a.p:.2g}, "
                    f"95% CI [{a.ci_low:+.4f}, {a.ci_high:+.4f}] (descriptive, not part of the decision rule)"
                )


def _tagged(args, log) -> int:
    variants = args.variants or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {','.join(unknown)}; known: {','.join(VARIANTS)}")
    seeds = args.seeds or list(SEEDS)
    result = run_study(
        args.out or "outputs/overopt_tagged", variants, seeds, overrides=args.overrides, jobs=args.jobs, log=log
    )
    print()
    print(result.table)
    print(f"\ncurves: {result.png}  ({result.minutes:.1f} min)")
    ends = {v: f"{c.end:.4f}" for v, c in result.curves.items()}
    dapo = result.curves.get("dapo")
    print(
        f"dapo_val_peak={dapo.peak if dapo else float('nan'):.4f} dapo_val_end={ends.get('dapo', 'nan')} "
        f"armor_val_end={ends.get('armor', 'nan')} mixed_only_val_end={ends.get('mixed_only', 'nan')} "
        f"anchors_only_val_end={ends.get('anchors_only', 'nan')} seeds={len(seeds)}"
    )
    return 0


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if not names:
        raise argparse.ArgumentTypeError(f"no variant named in {text!r}")
    return names


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s] or [int(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be a comma list of integers, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
