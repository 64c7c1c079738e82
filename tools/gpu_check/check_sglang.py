"""Optional check "sglang": one tiny colocated SGLang engine through a step's weight-sync order.

    python tools/gpu_check/check_sglang.py --hf HF_DIR --work DIR [--device cuda] [--json PATH]

Skipped, in one line naming what is missing, when ``sglang`` is not importable by the servers'
interpreter (``$SGLANG_PYTHON``, as ``rollout.sglang.python``; default this one) or without CUDA.
Otherwise the launcher starts one engine on the HF checkpoint as a colocated job does
(``--enable-memory-saver``, ``/health`` not generating) and, for ``disk`` and then ``distributed``
weight sync (NCCL, one communicator between this process and the engine), runs a step's order:
release every tag → resume the weights → push new weights → resume KV cache and CUDA graphs →
generate at T = 0.7 with log-probs. Each time the engine's log-probs of its sampled tokens are
compared with the trainer's (Megatron's ``compute_logprobs`` at ``temperature=0.7`` on the same
weights, fp32): mean |Δ| <= 1e-2, and the temperature-1 values must be farther than that (so the
check tells the conventions apart). The engine runs in fp32 without CUDA graphs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_lines import model_check_parser, report, skipped_or_ready  # noqa: E402

TEMPERATURE = 0.7
MEAN_ABS = 1e-2
MODES = ("disk", "distributed")


def parse_args(argv=None) -> argparse.Namespace:
    p = model_check_parser(__doc__)
    p.add_argument("--startup-timeout", type=float, default=240.0)
    return p.parse_args(argv)


def server_python() -> str:
    return os.environ.get("SGLANG_PYTHON") or sys.executable


def missing(device: str) -> str | None:
    """What this machine lacks for the SGLang check, or None."""
    if device == "cpu":
        return "SGLang needs CUDA (--device cpu)"
    python = server_python()
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        found = subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{python}: {err}"
    return None if found else f"sglang not importable by {python} (set SGLANG_PYTHON to the SGLang environment's)"


def hf_copy(hf_dir: str, weights, out: str) -> str:
    """An HF directory holding ``weights`` (config and tokenizer from ``hf_dir``): what the trainer loads."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(hf_dir):
        if not name.endswith((".safetensors", ".index.json")):
            shutil.copy(os.path.join(hf_dir, name), out)
    save_file({n: t.detach().cpu().contiguous() for n, t in weights}, os.path.join(out, "model.safetensors"))
    return out


def trainer_logprobs(hf_dir: str, samples, temperature: float) -> list[list[float]]:
    """Megatron's log-probs (the trainer's path) of each sample's response tokens at ``temperature``."""
    import torch

    from armor_megatron.megatron import dist
    from armor_megatron.megatron.hf_weights import load_weights
    from armor_megatron.megatron.logprobs import compute_logprobs
    from armor_megatron.megatron.model import build_gpt_model
    from armor_megatron.models import ModelArch

    arch = ModelArch.from_hf_dir(hf_dir)
    dist.initialize(dist.ParallelConfig(), arch)
    try:
        model = build_gpt_model(arch, dtype=torch.float32, use_te=False)
        load_weights([model], hf_dir)
        out = []
        for prompt, sample in samples:
            ids = torch.tensor([list(prompt) + list(sample.token_ids)])
            lp = compute_logprobs(
                [model],
                ids,
                torch.tensor([ids.shape[1]]),
                micro_batch_size=1,
                vocab_size=arch.vocab_size,
                temperature=temperature,
            )
            out.append(lp.logprobs[0, len(prompt) :].float().cpu().tolist())
        return out
    finally:
        dist.shutdown()


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(abs(x - y) for x, y in pairs) / max(1, len(pairs))


def main(argv=None) -> int:
    args = parse_args(argv)
    if skipped_or_ready(args.json, "sglang", missing(args.device), args.device):
        return 0
    import json

    from armor_megatron.rollout.engine import SamplingParams
    from armor_megatron.rollout.sglang.engine import SGLangEngine
    from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher
    from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig
    from armor_megatron.rollout.testing.tiny_models import tiny_weights

    with open(os.path.join(args.hf, "config.json")) as f:
        hf_config = json.load(f)
    launcher = SGLangLauncher(
        LauncherConfig(
            model_path=args.hf,
            colocated=True,
            mem_fraction_static=0.3,
            python=server_python(),
            extra_args=["--dtype", "float32", "--disable-cuda-graph"],
            log_dir=os.path.join(args.work, "sglang_logs"),
            startup_timeout=args.startup_timeout,
        )
    )
    sync = {
        "disk": WeightSyncConfig(mode="disk", disk_dir=os.path.join(args.work, "sglang_sync"), hf_config=hf_config),
        "distributed": WeightSyncConfig(mode="distributed", backend="nccl", timeout=120),
    }
    engine = SGLangEngine.launch(launcher, weight_sync=sync["disk"])
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    results, ok = {}, True
    try:
        for seed, mode in enumerate(MODES, start=1):
            client = engine if mode == "disk" else SGLangEngine(launcher.worker_urls, weight_sync=sync[mode])
            weights = [(n, t.cuda() if mode == "distributed" else t) for n, t in tiny_weights(hf_config, seed=seed)]
            client.release_memory()
            client.resume_memory(tags=("weights",))
            client.update_weights(weights, f"{mode}-{seed}")
            client.resume_memory(tags=("kv_cache", "cuda_graph"))
            groups = client.generate(prompts, 2, SamplingParams(max_new_tokens=8, temperature=TEMPERATURE))
            if client is not engine:
                client.shutdown()
            samples = [(prompts[i], s) for i, g in enumerate(groups) for s in g]
            trainer_dir = hf_copy(args.hf, weights, os.path.join(args.work, f"sglang_trainer_{mode}"))
            engine_lp = [list(s.logprobs or ()) for _, s in samples]
            at_t = mean_abs(engine_lp, trainer_logprobs(trainer_dir, samples, TEMPERATURE))
            at_1 = mean_abs(engine_lp, trainer_logprobs(trainer_dir, samples, 1.0))
            passed = at_t <= MEAN_ABS < at_1 and all(s.weight_version == f"{mode}-{seed}" for _, s in samples)
            results[mode] = {"mean_abs": at_t, "mean_abs_t1": at_1, "ok": passed}
            ok = ok and passed
    finally:
        engine.shutdown()
    line = "; ".join(
        f"{m}: release→resume→push→resume→generate, log-probs vs trainer at T={TEMPERATURE} "
        f"mean|d|={r['mean_abs']:.2e} (<= {MEAN_ABS}; at T=1: {r['mean_abs_t1']:.2e})"
        for m, r in results.items()
    )
    report(args.json, "sglang", ok, line, results=results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
