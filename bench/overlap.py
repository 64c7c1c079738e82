"""Step time of ``rollout.overlap: one_step`` against ``off``, side by side, on two CPU cores.

Setup: the tiny arithmetic task (``configs/tiny_cpu.yaml``, its model warmed up here), trained by
``armor-train`` through SGLang's HTTP protocol. The engines are the SGLang test double (a local
transformers engine behind SGLang's API, not SGLang) in their own processes pinned to core 0, the
policy group's and the frozen reference's; the trainer (Megatron actor and reference, one process,
one thread) is pinned to core 1; weights reach the engines by ``disk`` sync. Generation and update
are balanced from a measured ``off`` run: a short calibration run with one epoch per step times
generation, the trainer's log-probs and one epoch of the update on this machine, and
``train.epochs_per_step`` is set so that log-probs plus the update take as long as generation
(``--epochs`` fixes it instead); dynamic sampling is off so that every step generates one round. Both runs train the
same steps from the same start with TIS on (one_step requires it); the first step of each run
(start-up, nothing to overlap with yet) and the last (the final checkpoint) are left out of the times.

Printed: the calibration's phases and the epochs chosen; per run, the mean seconds per step, of generation (``time/generation``), of the
trainer's log-probs and update, the idle fractions, and the training reward at the end (mean of
the last quarter of the steps). The last line is
``step_time_ratio_overlap_vs_off= trainer_idle_frac_off= trainer_idle_frac_overlap= reward_end_off= reward_end_overlap=``.
The target ratio, with generation and update balanced and idle cores, is <= 0.55.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout too
from armor_megatron.config import load_config  # noqa: E402
from armor_megatron.launch.step_time import overlap_ratio  # noqa: E402
from armor_megatron.tasks.tiny_run import prepare_tiny_run  # noqa: E402
from armor_megatron.trainer.metrics_log import read_metrics  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(core: int | None):
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


def start_engine(model: str, core: int | None, log: str) -> tuple[subprocess.Popen, str]:
    """One SGLang test-double server on ``core``; returns (process, url) once it answers /health."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "armor_megatron.rollout.testing.sglang_test_server",
            "--model-path",
            model,
            "--port",
            str(port),
        ],
        env=dict(os.environ, **SINGLE_THREAD, PYTHONPATH=ROOT),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        preexec_fn=_pinned(core),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"engine did not start; see {log}") from None
            time.sleep(0.2)


def model_overrides(args) -> list[str]:
    """The tiny model's size: the update's FLOPs grow with it much faster than the engine's
    latency-bound decoding does, which is how the two sides are balanced."""
    return [
        f"model.arch.hidden_size={args.hidden}",
        f"model.arch.intermediate_size={2 * args.hidden}",
        f"model.arch.num_hidden_layers={args.layers}",
    ]


def train(work: str, name: str, paths: list[str], urls: tuple[str, str], overlap: str, args, core) -> list[dict]:
    overrides = [
        *paths,
        f"name={name}",
        f"checkpoint.dir={work}/{name}/ckpt",
        f"logging.dir={work}/runs",
        "parallelism.tp=1",
        "rollout.engine=sglang",
        f"rollout.sglang.urls=[{urls[0]}]",
        f"anchor.reference_urls=[{urls[1]}]",
        "rollout.sglang.weight_sync=disk",
        "rollout.sglang.placement=disaggregated",
        f"rollout.overlap={overlap}",
        "algorithm.tis.enabled=true",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group}",
        f"rollout.max_response_len={args.response_len}",
        f"train.micro_batch_size={args.prompts * args.group}",
        f"train.steps={args.steps}",
        f"optimizer.lr={args.lr}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.save_hf.at_end=false",
        "reference.tau=1000",
        "algorithm.dynamic_sampling.enabled=false",  # one round per step: the same generation work every step
        f"train.epochs_per_step={args.epochs}",
    ]
    cmd = [sys.executable, "-m", "armor_megatron.cli.train", "--config", CONFIG, *overrides]
    proc = subprocess.run(
        cmd,
        env=dict(os.environ, **SINGLE_THREAD, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        preexec_fn=_pinned(core),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return sorted(read_metrics(os.path.join(work, "runs", name, "metrics.jsonl")), key=lambda r: r["step"])


def balanced_epochs(calibration: dict) -> int:
    """Epochs per step that make the trainer's side as long as generation, from a one-epoch ``off`` run:
    ``logprobs + e * update_per_epoch ~= generation``, at least one."""
    per_epoch = max(calibration["update_s"], 1e-9)
    return max(1, round((calibration["generation_s"] - calibration["logprobs_s"]) / per_epoch))


def summary(records: list[dict]) -> dict:
    last = max(r["step"] for r in records)
    # step 1: start-up, nothing to overlap with yet; the last step: the final checkpoint
    steps = [r for r in records if 2 <= r["step"] < last]

    def mean(key, rows=steps):
        values = [float(r.get(key, 0.0)) for r in rows]
        return sum(values) / max(len(values), 1)

    tail = records[-max(len(records) // 4, 1) :]
    return {
        "step_s": mean("time/step"),
        "generation_s": mean("time/generation"),
        "trainer_s": mean("time/logprobs") + mean("time/update"),
        "logprobs_s": mean("time/logprobs"),
        "update_s": mean("time/update"),
        "wait_s": mean("time/rollout"),
        "trainer_idle_frac": mean("time/trainer_idle_frac"),
        "engine_idle_frac": mean("time/engine_idle_frac"),
        "reward_end": mean("rollout/reward", tail),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--response-len", type=int, default=8, help="max new tokens: the generation side's weight")
    p.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="hidden size of the tiny model (the update's FLOPs per epoch)",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="train.epochs_per_step (default: chosen by a calibration run so that the update takes as long as generation)",
    )
    p.add_argument("--calibration-steps", type=int, default=4, help="steps of the one-epoch calibration run")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--no-pin", action="store_true", help="leave the processes on every core")
    args = p.parse_args(argv)
    engine_core, trainer_core = (None, None) if args.no_pin else (0, 1)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        paths = [
            f"model.path={work}/hf",
            f"data.train_path={work}/train.jsonl",
            f"eval.datasets=[{{name: val, path: {work}/val.jsonl, k: 1}}]",
            *model_overrides(args),
        ]
        prepare_tiny_run(load_config(CONFIG, paths), num_val=16, warmup_steps=args.warmup_steps, log=None)
        engines = []
        try:
            for role in ("policy", "reference"):
                engines.append(start_engine(f"{work}/hf", engine_core, f"{work}/engine-{role}.log"))
            urls = (engines[0][1], engines[1][1])
            if args.epochs is None:
                calibration_args = argparse.Namespace(**{**vars(args), "epochs": 1, "steps": args.calibration_steps})
                calibration = summary(train(work, "calibration", paths, urls, "off", calibration_args, trainer_core))
                args.epochs = balanced_epochs(calibration)
                print(
                    f"calibration (off, 1 epoch, {args.calibration_steps} steps): "
                    f"generation {calibration['generation_s']:.3f} s, log-probs {calibration['logprobs_s']:.3f} s, "
                    f"update {calibration['update_s']:.3f} s an epoch -> train.epochs_per_step={args.epochs}",
                    flush=True,
                )
            results = {}
            for overlap in ("off", "one_step"):
                started = time.perf_counter()
                results[overlap] = summary(train(work, f"overlap-{overlap}", paths, urls, overlap, args, trainer_core))
                results[overlap]["wall_s"] = time.perf_counter() - started
                print(f"{overlap:>8}: " + json.dumps({k: round(v, 4) for k, v in results[overlap].items()}), flush=True)
        finally:
            for proc, _ in engines:
                proc.terminate()
                proc.wait(timeout=30)
    off, one = results["off"], results["one_step"]
    for overlap, r in results.items():
        print(
            f"phases {overlap}: generation {r['generation_s']:.3f} s, trainer {r['trainer_s']:.3f} s "
            f"(log-probs {r['logprobs_s']:.3f} + update {r['update_s']:.3f}), step {r['step_s']:.3f} s"
        )
    serial = max(off["step_s"] - off["generation_s"] - off["trainer_s"], 0.0)  # sync, rewards, metrics
    predicted = overlap_ratio(off["generation_s"], off["trainer_s"], serial)
    print(f"--plan's step-time model, from the off run's phases: one_step/off = {predicted:.3f}")
    print(
        f"step_time_ratio_overlap_vs_off={one['step_s'] / off['step_s']:.3f} "
        f"trainer_idle_frac_off={off['trainer_idle_frac']:.3f} "
        f"trainer_idle_frac_overlap={one['trainer_idle_frac']:.3f} "
        f"reward_end_off={off['reward_end']:.4f} reward_end_overlap={one['reward_end']:.4f}"
    )


if __name__ == "__main__":
    main()
