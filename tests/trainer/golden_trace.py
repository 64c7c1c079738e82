"""The golden metrics trace: a tiny seeded ARMOR run on CPU, its per-step numbers, and how close a
fresh run must come to the checked-in ones (``golden_trace.json``).

The run: the tiny random model of ``make_tiny_checkpoint(seed=0)`` (character tokenizer), 24
training prompts, 4 prompts x 4 responses a step, anchors from π_ref, TIS, a reference reset at
step 2, 4 steps on one thread in one process (world size 1, gloo). Its verifier rewards a response
that starts in the lower half of the tiny alphabet, so groups have signal without a warm-up.
`tests/trainer/test_golden_trace.py` compares a fresh run with the file;
``python tools/golden_trace.py`` rewrites it (after a change that is meant to move the numbers).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden_trace.json"
CONFIG = HERE.parents[1] / "configs" / "tiny_cpu.yaml"
LOW = "0123456789+-=? abcd"
STEPS = 4

# key: (relative, absolute) tolerance of |fresh − golden| <= absolute + relative·|golden|.
# Rewards and accuracies are fractions of 16 samples: any flip of a sampled token shows. The
# losses, gradient norm, entropy and log-prob statistics are float32 sums over about a hundred
# tokens: another CPU's kernels may move their last bits, well inside these bounds.
TOLERANCES: dict[str, tuple[float, float]] = {
    "rollout/reward": (0.0, 1e-6),
    "rollout/accuracy": (0.0, 1e-6),
    "rollout/reward_std": (0.0, 1e-5),
    "rollout/response_len": (0.0, 1e-6),
    "anchor/found_rate": (0.0, 1e-6),
    "train/num_tokens": (0.0, 0.0),
    "train/loss": (1e-3, 1e-7),
    "train/grad_norm": (1e-3, 1e-6),
    "train/entropy": (1e-4, 1e-6),
    "train/approx_kl_ref": (1e-2, 1e-7),
    "train/approx_kl_old": (1e-2, 1e-7),
    "train/ratio_mean": (1e-5, 1e-6),
    "train/mixture_weight_mean": (1e-5, 1e-6),
    "train/tis_weight_mean": (1e-5, 1e-6),
    "rollout/logprob_abs_diff": (0.0, 1e-5),
    "eval/val/pass@1": (0.0, 1e-6),
}


def starts_low(response: str, ground_truth: object) -> float:
    """1 when the response starts with a digit, an operator, a space or a-d, else 0."""
    return float(bool(response) and response[0] in LOW)


def overrides(data: Path, run: Path) -> list[str]:
    """The run's config overrides on ``configs/tiny_cpu.yaml``."""
    return [
        f"model.path={data}/hf",
        f"data.train_path={data}/train.jsonl",
        f"eval.datasets=[{{name: val, path: {data}/val.jsonl, k: 2}}]",
        "eval.max_response_len=6",
        "eval.every_steps=2",
        f"reward.verifier={__name__}:starts_low",
        "parallelism.tp=1",
        "train.deterministic=false",  # torch's global switch would outlive a test
        f"train.steps={STEPS}",
        "train.seed=7",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_response_len=6",
        "train.micro_batch_size=8",
        "reference.reset=every",
        "reference.tau=2",
        "algorithm.tis.enabled=true",
        "checkpoint.every_steps=0",
        "checkpoint.save_hf.at_end=false",
        f"checkpoint.dir={run}/ckpt",
        f"logging.dir={run}/runs",
        "name=golden",
    ]


def run_trace(workdir: Path) -> dict[str, dict[str, float]]:
    """Build the data in ``workdir``, train, and return ``{step: {key: value}}`` for `TOLERANCES`' keys.

    Needs torch.distributed's world of this process (the tests' ``world_of_one`` fixture).
    """
    import torch

    from armor_megatron.config import load_config
    from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint
    from armor_megatron.trainer.metrics_log import read_metrics
    from armor_megatron.trainer.run import train

    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    make_tiny_checkpoint(str(data / "hf"), seed=0)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    for name, part in (("train", rows[:24]), ("val", rows[24:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cfg = load_config(str(CONFIG), overrides(data, workdir / "run"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums on any machine's thread count
    try:
        train(cfg, None)
    finally:
        torch.set_num_threads(threads)
    logged = read_metrics(os.path.join(cfg.logging.dir, cfg.name, "metrics.jsonl"))
    return {str(r["step"]): {k: float(r[k]) for k in TOLERANCES if k in r} for r in logged}


def differences(golden: dict[str, dict[str, float]], fresh: dict[str, dict[str, float]]) -> list[str]:
    """One line per value of ``fresh`` outside its tolerance of ``golden``, or missing on either side."""
    out = []
    for step in sorted(set(golden) | set(fresh), key=int):
        g, f = golden.get(step, {}), fresh.get(step, {})
        for key in sorted(set(g) | set(f)):
            if key not in g or key not in f:
                out.append(f"step {step} {key}: golden {g.get(key, '-')}, fresh {f.get(key, '-')}")
                continue
            rel, abs_ = TOLERANCES[key]
            if not math.isclose(f[key], g[key], rel_tol=rel, abs_tol=abs_):
                out.append(
                    f"step {step} {key}: golden {g[key]!r}, fresh {f[key]!r} (tolerance {abs_:g} + {rel:g}·|golden|)"
                )
    return out


def write(trace: dict[str, dict[str, float]]) -> None:
    """Write ``trace`` as the golden file (atomically)."""
    tmp = GOLDEN.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"steps": trace}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, GOLDEN)


def read() -> dict[str, dict[str, float]]:
    """The checked-in trace."""
    return json.loads(GOLDEN.read_text())["steps"]
