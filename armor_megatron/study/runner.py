"""The over-optimisation study.

Training variants × seeds of ``armor-train`` on the tagged-addition task
(``configs/tiny_overopt.yaml``), side by side on the CPUs, then curves, a table and the verdict.

Variants differ only by config overrides on top of ``configs/tiny_overopt.yaml`` (ARMOR as the
paper runs it: anchors, α = 0.9375, reset every τ, no anchor cache):

==================  =====================================================================
dapo                anchors off, α = 1 (plain clipped ratio)
armor               the config as it is
mixed_only          mixed ratio without anchors
anchors_only        anchors with α = 1
armor_no_reset      ARMOR whose reference is never reset
armor_cache         ARMOR reusing each prompt's verified anchors until the next reset
recovery            ARMOR started from DAPO's last checkpoint (same seed), its reference set to
                    the saved DAPO checkpoint with the best validation accuracy (the warm-up
                    model counts as step 0), never reset, for a quarter of the other runs' steps
dapo_no_cue         the control: DAPO on the training problems with random tags (no cue), to
                    show what the cue, not RL itself, does to validation accuracy
==================  =====================================================================

Every run is one ``armor-train`` process (TP = 1), with ``train.seed`` and ``rollout.seed`` set
to the seed; all start from one warmed-up model. A run whose metrics already reach its last step
with the same command line, config file and warmed-up model is not run again, so an interrupted
study resumes where it stopped (a run cut short starts again from step 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from armor_megatron.config import load_config
from armor_megatron.tasks.arithmetic import write_jsonl
from armor_megatron.tasks.study_stats import VAL, VariantCurves, variant_curves, verdict
from armor_megatron.tasks.tagged_addition import without_cue
from armor_megatron.tasks.tiny_run import RECIPE, prepare_tiny_run
from armor_megatron.trainer.metrics_log import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_overopt.yaml")
SEEDS = (1, 2, 3)  # fixed before the first study ran
TASK = {"task": "tagged_addition", "num_val": 256, "warmup_steps": 500, "seed": 0}
DAPO_CHECKPOINT_EVERY = 50  # DAPO's saved checkpoints: the recovery run's reference candidates
RECOVERY_FRACTION = 4  # the recovery run trains a quarter of the other runs' steps

VARIANTS = {
    "dapo": ("DAPO", ["anchor.enabled=false", "algorithm.alpha=1.0"]),
    "armor": ("ARMOR", []),
    "mixed_only": ("mixed ratio, no anchors", ["anchor.enabled=false"]),
    "anchors_only": ("anchors, α = 1", ["algorithm.alpha=1.0"]),
    "armor_no_reset": ("ARMOR, no resets", ["reference.reset=never"]),
    "armor_cache": ("ARMOR + anchor cache", ["anchor.cache=true"]),
    "recovery": ("ARMOR from DAPO's end", ["reference.reset=never"]),
    "dapo_no_cue": (
        "DAPO, control: no cue",
        ["anchor.enabled=false", "algorithm.alpha=1.0", "data.train_path={out}/train_no_cue.jsonl"],
    ),
}


@dataclasses.dataclass
class StudyResult:
    """The study's curves per variant, its table, figure and duration."""

    curves: dict[str, VariantCurves]
    table: str
    png: str
    minutes: float


def run_study(
    out: str,
    variants: Sequence[str],
    seeds: Sequence[int] = SEEDS,
    *,
    config: str = CONFIG,
    overrides: Sequence[str] = (),
    jobs: int | None = None,
    task: dict = TASK,
    log: Callable[[str], None] = print,
) -> StudyResult:
    """Run every variant and seed of the study, then write its figure, table and summary.

    Run ``variants`` × ``seeds`` in ``out`` with ``jobs`` processes at a time (default: one per
    CPU), then write ``out/curves.png``, ``out/table.md`` and ``out/summary.json``. ``task`` is
    passed to ``prepare_tiny_run`` (the task, its sizes and the warm-up).
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if "recovery" in variants and "dapo" not in variants:
        raise ValueError("variant recovery starts from DAPO's checkpoints: add variant dapo")
    started = time.time()
    out = os.path.abspath(out)
    paths = [
        f"model.path={out}/hf",
        f"data.train_path={out}/train.jsonl",
        f"eval.datasets=[{{name: tagged-val, path: {out}/val.jsonl, k: 1}}]",
        f"logging.dir={out}/runs",
    ]
    cfg = load_config(config, paths + list(overrides))
    log(f"preparing the warmed-up model and the tagged-addition data in {out}")
    rows = prepare_tiny_run(cfg, log=log, **task)
    if "dapo_no_cue" in variants:
        write_jsonl(os.path.join(out, "train_no_cue.jsonl"), without_cue(rows["train"], seed=task.get("seed", 0)))
    jobs = jobs or os.cpu_count() or 1
    base = [sys.executable, "-m", "armor_megatron.cli.train", "--config", config, *paths, *overrides]

    def command(variant: str, seed: int, extra: Sequence[str] = ()) -> list[str]:
        name = f"{variant}-s{seed}"
        every = DAPO_CHECKPOINT_EVERY if variant == "dapo" else cfg.train.steps
        return [
            *base,
            *(o.format(out=out) for o in VARIANTS[variant][1]),
            *extra,
            f"name={name}",
            f"checkpoint.dir={out}/ckpt/{name}",
            f"checkpoint.every_steps={every}",
            f"train.seed={seed}",
            f"rollout.seed={seed}",
            "checkpoint.resume=none",
        ]

    with open(config, "rb") as f, open(os.path.join(out, "hf", RECIPE)) as g:  # what a finished run was made from
        stamp = {"config_sha256": hashlib.sha256(f.read()).hexdigest(), "model": json.load(g)}
    first = [(v, s, command(v, s)) for v in variants if v != "recovery" for s in seeds]
    _run_all(first, out, jobs, stamp, log)
    if "recovery" in variants:
        recovery = []
        for s in seeds:
            policy, reference = _recovery_start(
                os.path.join(out, "ckpt", f"dapo-s{s}"), _records(out, "dapo", s), os.path.join(out, "hf")
            )
            log(f"recovery seed {s}: policy {policy}, reference {reference}")
            extra = [
                f"model.mcore_path={policy}",
                f"reference.init_from={reference}",
                f"train.steps={max(1, cfg.train.steps // RECOVERY_FRACTION)}",
            ]
            recovery.append(("recovery", s, command("recovery", s, extra)))
        _run_all(recovery, out, jobs, stamp, log)

    curves = {
        v: variant_curves(
            v, [_records(out, v, s) for s in seeds], step_offset=cfg.train.steps if v == "recovery" else 0
        )
        for v in variants
    }
    from armor_megatron.study.plots import plot_study

    png = os.path.join(out, "curves.png")
    labels = {v: VARIANTS[v][0] for v in variants}
    spread = "mean ± sd over seeds" if len(seeds) > 1 else "one seed, no spread"
    plot_study(
        curves, labels, png, title=f"tagged addition: validation accuracy (greedy), {len(seeds)} seed(s), {spread}"
    )
    table = study_table(curves, labels)
    _write(os.path.join(out, "table.md"), table + "\n")
    _write(os.path.join(out, "summary.json"), json.dumps({v: dataclasses.asdict(c) for v, c in curves.items()}) + "\n")
    return StudyResult(curves, table, png, (time.time() - started) / 60)


def study_table(curves: dict[str, VariantCurves], labels: dict[str, str]) -> str:
    """A Markdown table.

    Per variant its validation start, peak (step), end ± sd and training reward at the end; then the
    verdict lines when DAPO and ARMOR both ran.
    """
    lines = [
        "| variant | seeds | val start | val peak (step) | val end ± sd | train reward end |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in curves.items():
        lines.append(
            f"| {labels[name]} | {c.seeds} | {c.start:.3f} | {c.peak:.3f} ({c.peak_step}) | "
            f"{c.end:.3f} ± {_f(c.end_sd)} | {_f(c.train_end)} |"
        )
    if "dapo" in curves and "armor" in curves and min(curves["dapo"].seeds, curves["armor"].seeds) < 2:
        lines += ["", "One seed: no verdict (it needs the spread over seeds; examples/overopt_study.py runs three)."]
    elif "dapo" in curves and "armor" in curves:
        v = verdict(curves["dapo"], curves["armor"])
        lines += [
            "",
            f"DAPO peak − end = {v.dapo_drop:+.3f} (2 pooled SE = {_f(2 * v.dapo_drop_se)}): "
            f"over-optimisation {'seen' if v.overoptimisation_seen else 'not established'}.",
            f"ARMOR end − DAPO end = {v.armor_gain:+.3f} (2 pooled SE = {_f(2 * v.armor_gain_se)}): "
            f"ARMOR {'beats DAPO' if v.armor_beats_dapo else 'does not beat DAPO by 2 SE'}.",
        ]
    return "\n".join(lines)


def _f(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3f}"


def _records(out: str, variant: str, seed: int) -> list[dict]:
    return read_metrics(os.path.join(out, "runs", f"{variant}-s{seed}", "metrics.jsonl"))


def _recovery_start(ckpt_dir: str, dapo_records: list[dict], hf_dir: str) -> tuple[str, str]:
    """Where the recovery run starts: DAPO's last checkpoint and its best one.

    (DAPO's last checkpoint, the saved DAPO checkpoint with the best validation accuracy —
    the warm-up model, the HF directory ``hf_dir`` the runs start from, counting as step 0; the
    earliest on a tie).
    """
    saved = {
        int(d.removeprefix("iter_")): os.path.join(ckpt_dir, d) for d in os.listdir(ckpt_dir) if d.startswith("iter_")
    }
    saved[0] = hf_dir
    val = {r["step"]: float(r[VAL]) for r in dapo_records if r.get(VAL) is not None}
    scored = [s for s in saved if s in val]
    if not scored or max(saved) not in val:
        raise ValueError(f"{ckpt_dir}: DAPO's saved checkpoints {sorted(saved)} lack validation scores")
    best = max(scored, key=lambda s: (val[s], -s))
    return saved[max(saved)], saved[best]


def _run_all(
    runs: list[tuple[str, int, list[str]]],
    out: str,
    jobs: int,
    stamp: dict,
    log: Callable[[str], None],
    *,
    provenance: dict | None = None,
) -> None:
    """Run the commands ``jobs`` at a time (one torch thread each when several run).

    The first failure stops the study with the tail of that run's log. A run is skipped when its
    marker records the same command and ``stamp`` (config file, warmed-up model). With
    ``provenance`` (the code's commit and dirty flag) the marker also records it, with the run's
    start and end times (UTC), under ``"provenance"``.
    """
    env = dict(os.environ)
    if jobs > 1:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)

    def one(variant: str, seed: int, cmd: list[str]) -> None:
        name = f"{variant}-s{seed}"
        done = os.path.join(out, "logs", f"{name}.done")
        made_from = {"command": cmd, **json.loads(json.dumps(stamp))}  # JSON types, as read back
        if os.path.isfile(done):
            with open(done) as f:
                recorded = json.load(f)
            recorded.pop("provenance", None)
            if recorded == made_from:
                log(f"{name}: already done")
                return
        log(f"{name}: training")
        shutil.rmtree(os.path.join(out, "ckpt", name), ignore_errors=True)  # a fresh start
        t0 = time.time()
        log_path = os.path.join(out, "logs", f"{name}.log")
        with open(log_path, "w") as f:
            code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if code:
            with open(log_path) as f:
                tail = "".join(f.readlines()[-15:])
            raise RuntimeError(f"{name} failed with exit code {code} (log {log_path}):\n{tail}")
        if provenance is not None:
            made_from["provenance"] = {**provenance, "started": _utc(t0), "ended": _utc(time.time())}
        _write(done, json.dumps(made_from, sort_keys=True))
        log(f"{name}: done in {(time.time() - t0) / 60:.1f} min")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, *run) for run in runs]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()  # runs not started yet; those running finish
            raise


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the visible-shortcut study
WORKED_CONFIG = os.path.join(ROOT, "configs", "tiny_overopt_worked.yaml")
# chosen by the pilots (examples/overopt_pilots.md), fixed by examples/overopt_preregistration.md
WORKED_TASK = {"task": "worked_addition", "num_val": 256, "warmup_steps": 600, "warmup_lr": 3e-3}
WORKED_SPLIT = {"w_prob": 0.6, "d_cue": 1.0}  # worked_addition.split_problems options
WORKED_RHO = 1.0  # the cue's share of RL training rows

WORKED_VARIANTS = {
    "dapo": ("DAPO", ["anchor.enabled=false", "algorithm.alpha=1.0"]),
    "armor": ("ARMOR", []),
    "mixed_only": ("mixed ratio, no anchors", ["anchor.enabled=false"]),
    "anchors_only": ("anchors, α = 1", ["algorithm.alpha=1.0"]),
    "armor_resets": ("ARMOR with resets (τ = 100)", ["reference.reset=every", "reference.tau=100"]),
    "dapo_no_cue": (
        "DAPO, control: ρ = 0",
        ["anchor.enabled=false", "algorithm.alpha=1.0", "data.train_path={seed_dir}/train_rho0.jsonl"],
    ),
}


@dataclasses.dataclass
class PairedResult:
    """The paired study's runs per variant, seeds, figure and duration."""

    runs: dict  # variant -> [RunSummary], in the order of ``seeds``
    seeds: list[int]
    png: str
    minutes: float  # wall time
    cpu_minutes: float  # CPU time of this process and every process it waited for
    variant_seeds: dict  # variant -> its seeds, in the order of ``runs[variant]``


def _seed_paths(warm: str, seed: int, rho: float) -> list[str]:
    d = os.path.join(warm, f"s{seed}")
    return [
        f"model.path={d}/hf",
        f"data.train_path={d}/train_rho{rho:g}.jsonl",
        f"eval.datasets=[{{name: worked-val, path: {d}/val.jsonl, k: 4}}]",
    ]


def _prepare_seed(config: str, warm: str, seed: int, rho: float, overrides: Sequence[str], task: dict, threads: int):
    """One seed's data and warm-up (in a worker process).

    ``warm/s<seed>/`` holds the warmed-up model ``hf``, ``val.jsonl`` and the training sets
    ``train_rho<ρ>.jsonl`` (ρ and 0).
    """
    import torch

    from armor_megatron.tasks.worked_addition import split_problems

    torch.set_num_threads(threads)
    cfg = load_config(config, [*_seed_paths(warm, seed, rho), *overrides])
    options = {k: v for k, v in task.items() if k not in ("task", *WORKED_SPLIT)}
    split = {"rho": rho, **{k: task.get(k, v) for k, v in WORKED_SPLIT.items()}}
    prepare_tiny_run(cfg, task=task["task"], seed=seed, options=split, log=None, **options)
    no_cue, _, _ = split_problems(task["num_val"], seed=seed, **{**split, "rho": 0.0})
    write_jsonl(os.path.join(warm, f"s{seed}", "train_rho0.jsonl"), no_cue)
    with open(os.path.join(warm, f"s{seed}", "hf", RECIPE)) as f:
        return json.load(f)


def run_paired(
    out: str,
    variants: Sequence[str],
    seeds: Sequence[int],
    *,
    rho: float = WORKED_RHO,
    config: str = WORKED_CONFIG,
    overrides: Sequence[str] = (),
    jobs: int | None = None,
    task: dict = WORKED_TASK,
    title: str = "",
    warmup_dir: str | None = None,
    variant_seeds: dict[str, Sequence[int]] | None = None,
    log: Callable[[str], None] = print,
) -> PairedResult:
    """The visible-shortcut study.

    Per seed one warm-up (``<warmup_dir>/s<seed>``, default ``out``) that every variant of that seed
    starts from, with the same data and data order; then ``variants`` × ``seeds`` of ``armor-train``
    ``jobs`` at a time (``variant_seeds`` gives a variant a subset of ``seeds``); then
    ``out/curves.png`` and ``out/summary.json``. ``runs[v]`` holds variant v's summaries in the
    order of its seeds (``PairedResult.variant_seeds``).
    """
    import resource
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from armor_megatron.tasks.overopt_checks import summarize_run

    unknown = [v for v in variants if v not in WORKED_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(WORKED_VARIANTS)}")
    started, cpu0 = time.time(), _cpu_seconds(resource)
    out = os.path.abspath(out)
    warm = os.path.abspath(warmup_dir or out)
    jobs = jobs or os.cpu_count() or 1
    log(f"warm-up of seed(s) {', '.join(map(str, seeds))} in {warm} ({jobs} at a time)")
    with ProcessPoolExecutor(max_workers=min(jobs, len(seeds)), mp_context=get_context("spawn")) as pool:
        # one torch thread each: the tiny model's ops are too small for threads to pay (12x the CPU time with 2)
        futures = {s: pool.submit(_prepare_seed, config, warm, s, rho, tuple(overrides), task, 1) for s in seeds}
        recipes = {s: f.result() for s, f in futures.items()}
    log(f"warm-up done in {(time.time() - started) / 60:.1f} min")
    with open(config, "rb") as f:
        stamp = {"config_sha256": hashlib.sha256(f.read()).hexdigest(), "models": recipes, "rho": rho}
    runs = []
    per_variant = {v: list((variant_seeds or {}).get(v, seeds)) for v in variants}
    stray = {v: sorted(set(ss) - set(seeds)) for v, ss in per_variant.items() if set(ss) - set(seeds)}
    if stray:
        raise ValueError(f"variant_seeds outside the study's seeds: {stray}")
    for v in variants:  # variant by variant, so the first variants' seeds are complete first
        for seed in per_variant[v]:
            seed_dir = os.path.join(warm, f"s{seed}")
            name = f"{v}-s{seed}"
            runs.append(
                (
                    v,
                    seed,
                    [
                        sys.executable,
                        "-m",
                        "armor_megatron.cli.train",
                        "--config",
                        config,
                        *_seed_paths(warm, seed, rho),
                        f"logging.dir={out}/runs",
                        *overrides,
                        *(o.format(seed_dir=seed_dir) for o in WORKED_VARIANTS[v][1]),
                        f"name={name}",
                        f"checkpoint.dir={out}/ckpt/{name}",
                        f"train.seed={seed}",
                        f"rollout.seed={seed}",
                        "checkpoint.resume=none",
                    ],
                )
            )
    _run_all(runs, out, jobs, stamp, log)
    summaries = {v: [summarize_run(_records(out, v, s)) for s in per_variant[v]] for v in variants}
    png = os.path.join(out, "curves.png")
    plot_paired(summaries, {v: WORKED_VARIANTS[v][0] for v in variants}, png, title=title, seeds=len(seeds))
    result = PairedResult(
        summaries,
        list(seeds),
        png,
        (time.time() - started) / 60,
        (_cpu_seconds(resource) - cpu0) / 60,
        per_variant,
    )
    _write(
        os.path.join(out, "summary.json"),
        json.dumps(
            {
                "seeds": per_variant,
                "rho": rho,
                "minutes": result.minutes,
                "cpu_minutes": result.cpu_minutes,
                "runs": {v: [dataclasses.asdict(r) for r in rs] for v, rs in summaries.items()},
            }
        )
        + "\n",
    )
    return result


def _cpu_seconds(resource) -> float:
    """User + system CPU seconds of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plot_paired(runs: dict, labels: dict, out: str, *, title: str = "", seeds: int = 1) -> None:
    """Plot validation accuracy and the share of direct responses per variant.

    Validation accuracy (top) and the share of direct (D) validation responses (bottom) per
    variant over the steps: the mean over seeds as a line (every seed faint when there are
    several); DAPO's peak of the mean curve marked. Written to ``out`` (PNG), atomically.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from armor_megatron.tasks.overopt_checks import WINDOW, mean_curve
    from armor_megatron.trainer.plotting import save_png

    fig, (val_ax, d_ax) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for i, (name, rs) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        curve = mean_curve(rs)
        if len(rs) > 1:
            for r in rs:
                val_ax.plot(r.steps, r.val, color=colour, alpha=0.2, linewidth=0.8)
                d_ax.plot(r.steps, r.val_d_share, color=colour, alpha=0.2, linewidth=0.8)
        val_ax.plot(curve.steps, curve.val, color=colour, marker=".", label=labels.get(name, name))
        d_ax.plot(curve.steps, curve.d_share, color=colour, marker=".", label=labels.get(name, name))
        if name == "dapo":
            val_ax.plot([curve.peak_step], [curve.peak], marker="*", markersize=16, color=colour, linestyle="none")
            val_ax.annotate(
                f"DAPO peak {curve.peak:.3f} (step {curve.peak_step})",
                (curve.peak_step, curve.peak),
                textcoords="offset points",
                xytext=(8, 8),
            )
    last = max(r.last_step for rs in runs.values() for r in rs)
    for ax in (val_ax, d_ax):
        ax.axvspan(last - WINDOW, last, color="0.85", alpha=0.5, linewidth=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    what = f"mean of {seeds} seeds (faint: each seed)" if seeds > 1 else "one seed, no spread"
    val_ax.set_title(title or f"worked addition: validation accuracy (avg@4, T = 1), {what}")
    val_ax.set_ylabel("validation accuracy")
    d_ax.set_title("share of direct (D) answers among validation responses")
    d_ax.set_ylabel("D-share")
    d_ax.set_xlabel(f"step (shaded: the last {WINDOW} steps, the endpoint window)")
    fig.tight_layout()
    try:
        save_png(fig, out)
    finally:
        plt.close(fig)
