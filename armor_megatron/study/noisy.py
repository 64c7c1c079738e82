"""The third design of the over-optimisation study: warm-ups, the V0 gate and runs on the noisy cue.

Per seed, one warm-up (``<warm>/s<seed>/hf``: π_ref and the start of every run of that seed), its
data (``train.jsonl`` of the design, ``val.jsonl`` with near-miss tags, ``tagless_val.jsonl``) and
the V0 probe of π_ref on the RL training prompts (``v0.json``; ``tasks/v0_gate.py``). Seeds that fail
V0 stop there: no RL runs on them unless ``force``. Then ``variants`` × seeds of ``armor-train``.

Every run's done-marker records what it was made from (command, config file, warmed-up model) and
its provenance (``provenance``: the code commit, whether the tree had uncommitted changes, start and
end times); ``summary.json`` records the same for the study, and refuses runs of another commit
unless ``mix_commits``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from armor_megatron.config import load_config
from armor_megatron.study.runner import _cpu_seconds, _run_all, _utc, _write
from armor_megatron.tasks.arithmetic import write_jsonl
from armor_megatron.tasks.noisy_cue import COPY_PREFIX, mode, split_problems, tagless_rows
from armor_megatron.tasks.tiny_run import RECIPE, prepare_tiny_run
from armor_megatron.tasks.v0_gate import MIN_PROMPTS, V0Result, v0_statistics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISY_CONFIG = os.path.join(ROOT, "configs", "tiny_overopt_noisy.yaml")
NOISY_TASK = {"num_val": 256, "warmup_steps": 600, "warmup_lr": 3e-3, "max_operand": 30}
NOISY_SPLIT = {
    "design": "rare_cue",
    "q": 0.85,
    "copy_prob": 0.03,
    "warm_right": 0.5,
    "rl_pairs": 0,
    "copy_drills": 0,
    "w_slip": 0.0,
}

DAPO = ["anchor.enabled=false", "algorithm.alpha=1.0"]
NOISY_VARIANTS = {
    "dapo": ("DAPO", DAPO),
    "armor": ("ARMOR", []),
    "dapo_kl": ("DAPO + KL to π_ref (β = 0.04, k3)", [*DAPO, "algorithm.kl_loss.coef=0.04"]),  # GRPO's β
    "dapo_half_lr": ("DAPO at half the learning rate", [*DAPO, "optimizer.lr=1.0e-4"]),
    "mixed_only": ("mixed ratio, no anchors", ["anchor.enabled=false"]),
    "anchors_only": ("anchors, α = 1", ["algorithm.alpha=1.0"]),
}


def provenance() -> dict:
    """The code's commit and whether the work tree has uncommitted changes (``git`` in the repository)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def _seed_paths(warm: str, seed: int) -> list[str]:
    d = os.path.join(warm, f"s{seed}")
    return [
        f"model.path={d}/hf",
        f"data.train_path={d}/train.jsonl",
        f"eval.datasets=[{{name: noisy-val, path: {d}/val.jsonl, k: 4}}]",
    ]


def prepare_seed(config: str, warm: str, seed: int, split: dict, task: dict, threads: int = 1) -> dict:
    """One seed's warm-up, data and V0 probe (in a worker process); returns {"recipe", "v0"}."""
    import torch

    torch.set_num_threads(threads)
    d = os.path.join(warm, f"s{seed}")
    cfg = load_config(config, _seed_paths(warm, seed))
    rows = prepare_tiny_run(cfg, task="noisy_cue", seed=seed, options=split, log=None, **task)
    write_jsonl(os.path.join(d, "tagless_val.jsonl"), tagless_rows(rows["val"]))
    with open(os.path.join(d, "hf", RECIPE)) as f:
        recipe = json.load(f)
    v0_path = os.path.join(d, "v0.json")
    stamp = hashlib.sha256(json.dumps([recipe, split], sort_keys=True).encode()).hexdigest()  # the probe's rows too
    if os.path.isfile(v0_path):
        with open(v0_path) as f:
            saved = json.load(f)
        if saved.get("recipe_sha256") == stamp:
            return {"recipe": recipe, "v0": saved["v0"]}
    # the probe reads the tagged training prompts at q, the rows the shortcut is learnt on in either design
    probe_rows, _, _ = split_problems(
        task["num_val"], seed=seed, max_operand=task["max_operand"], **{**split, "design": "rare_cue"}
    )
    result = probe_reference(
        os.path.join(d, "hf"), probe_rows, mode, shortcut="C", general="W", shortcut_prefix=COPY_PREFIX, seed=seed
    )
    v0 = dataclasses.asdict(result)
    _write(v0_path, json.dumps({"recipe_sha256": stamp, "v0": v0}) + "\n")
    return {"recipe": recipe, "v0": v0}


@dataclasses.dataclass
class PilotResult:
    """The V0 results per seed, the seeds whose runs ran, and the study's durations."""

    v0: dict[int, V0Result]
    ran: list[int]
    minutes: float
    cpu_minutes: float


def run_noisy(
    out: str,
    variants: Sequence[str],
    seeds: Sequence[int],
    *,
    split: dict = NOISY_SPLIT,
    task: dict = NOISY_TASK,
    config: str = NOISY_CONFIG,
    overrides: Sequence[str] = (),
    jobs: int | None = None,
    warmup_dir: str | None = None,
    force: bool = False,
    mix_commits: bool = False,
    log: Callable[[str], None] = print,
) -> PilotResult:
    """Warm-ups and V0 for ``seeds``, then ``variants`` × the seeds that pass V0 (every seed with ``force``)."""
    import resource
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    unknown = [v for v in variants if v not in NOISY_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(NOISY_VARIANTS)}")
    started, cpu0 = time.time(), _cpu_seconds(resource)
    out, warm = os.path.abspath(out), os.path.abspath(warmup_dir or out)
    jobs = jobs or os.cpu_count() or 1
    os.makedirs(out, exist_ok=True)
    code = provenance()
    _check_commit(out, code, mix_commits)
    log(f"warm-up and V0 of seed(s) {', '.join(map(str, seeds))} in {warm} ({jobs} at a time), {split}")
    with ProcessPoolExecutor(max_workers=min(jobs, len(seeds)), mp_context=get_context("spawn")) as pool:
        futures = {s: pool.submit(prepare_seed, config, warm, s, dict(split), dict(task)) for s in seeds}
        prepared = {s: f.result() for s, f in futures.items()}
    v0 = {s: V0Result(**p["v0"]) for s, p in prepared.items()}
    for s in seeds:
        log(f"seed {s}: {v0[s].line()}")
    ran = [s for s in seeds if force or v0[s].passed]
    if ran and variants:
        with open(config, "rb") as f:
            stamp = {
                "config_sha256": hashlib.sha256(f.read()).hexdigest(),
                "models": {s: prepared[s]["recipe"] for s in ran},
                "split": dict(split),
            }
        extra = ["data.shuffle=false"] if split.get("design") == "dormant" else []
        runs = []
        for v in variants:
            for s in ran:
                name = f"{v}-s{s}"
                cmd = [sys.executable, "-m", "armor_megatron.cli.train", "--config", config, *_seed_paths(warm, s)]
                cmd += [f"logging.dir={out}/runs", *extra, *overrides, *NOISY_VARIANTS[v][1], f"name={name}"]
                cmd += [f"checkpoint.dir={out}/ckpt/{name}", f"train.seed={s}", f"rollout.seed={s}"]
                runs.append((v, s, [*cmd, "checkpoint.resume=none"]))
        _run_all(runs, out, jobs, stamp, log, provenance=code)
    result = PilotResult(v0, ran, (time.time() - started) / 60, (_cpu_seconds(resource) - cpu0) / 60)
    summary = {
        **code,
        "started": _utc(started),
        "ended": _utc(time.time()),
        "split": dict(split),
        "task": dict(task),
        "variants": list(variants),
        "v0": {s: dataclasses.asdict(r) for s, r in v0.items()},
        "ran": ran,
        "minutes": result.minutes,
        "cpu_minutes": result.cpu_minutes,
    }
    _write(os.path.join(out, "summary.json"), json.dumps(summary) + "\n")
    return result


def _check_commit(out: str, code: dict, mix_commits: bool) -> None:
    """Refuse to add runs of this code to ``out`` when earlier runs there came from another commit."""
    logs = os.path.join(out, "logs")
    if mix_commits or not os.path.isdir(logs):
        return
    for name in sorted(os.listdir(logs)):
        if name.endswith(".done"):
            with open(os.path.join(logs, name)) as f:
                earlier = json.load(f).get("provenance", {}).get("commit")
            if earlier != code["commit"]:
                raise ValueError(
                    f"{out}: run {name[: -len('.done')]} came from commit {earlier}, this code is {code['commit']}; "
                    "use another --out, or allow mixing commits"
                )


def probe_reference(
    model_dir: str,
    rows: Sequence[Mapping],
    mode: Callable[[str], str],
    *,
    shortcut: str,
    general: str,
    shortcut_prefix: str,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 12,
    temperature: float = 1.0,
    seed: int = 0,
    verifier: str = "math",
) -> V0Result:
    """Sample and score π_ref (the HF model in ``model_dir``) on ``rows`` (``prompt``, ``answer``) for the gate.

    The free samples and the forced ones (the prompt followed by ``shortcut_prefix``, which is then
    part of the scored response) come from the local engine at ``temperature``, seeded.
    """
    from armor_megatron.rewards.registry import get_verifier
    from armor_megatron.rollout.engine import SamplingParams
    from armor_megatron.rollout.local import LocalEngine

    if len(rows) < MIN_PROMPTS:
        raise ValueError(f"the V0 probe needs at least {MIN_PROMPTS} training prompts, got {len(rows)}")
    engine = LocalEngine.from_pretrained(model_dir, seed=seed, max_batch_size=256)
    tok, score = engine.tokenizer, get_verifier(verifier)
    try:

        def draw(prefix: str, call_seed: int) -> list[list[tuple[str, float]]]:
            ids = [tok.encode(r["prompt"] + prefix, add_special_tokens=False) for r in rows]
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_token_ids=engine.eos_token_ids,
                seed=call_seed,
            )
            out = engine.generate(ids, samples_per_prompt, sampling, return_logprob=False)
            return [
                [(prefix + s.text, float(score(prefix + s.text, r["answer"]).score)) for s in group]
                for r, group in zip(rows, out)
            ]

        return v0_statistics(draw("", seed), draw(shortcut_prefix, seed + 1), mode, shortcut=shortcut, general=general)
    finally:
        engine.shutdown()
