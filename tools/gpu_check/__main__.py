"""The first-GPU acceptance check: four checks on one device, one line each, then the verdict.

    python tools/gpu_check [--device cuda|cpu] [--work DIR] [--logs DIR] [--budget SECONDS]
                           [--only parity,train,throughput,memory] [--warmup-steps N] [--seq-len N] ...

(``tools/gpu_check.sh`` installs the carried wheels first and then runs this.)

0. prepare: the tiny model of configs/gpu_check.yaml, warmed up on synthetic arithmetic (CPU);
1. parity: its log-probs through the trainer's path in bf16 on the device vs transformers fp32
   on the CPU (check_parity.py states the tolerances and why);
2. train: ``armor-train`` for 3 steps on the device with anchors, a reference reset, a
   checkpoint and a resume (check_train.py);
3. throughput: tokens/s and MFU of the actor's train step on a random Qwen2.5-0.5B-shaped model
   at sequence 4096 (check_throughput.py states the FLOP formula);
4. memory: the colocated step's trainer phases (to the device, log-probs, update, to the host,
   weights streamed from the host copy), the device-memory ledger's bytes beside
   ``torch.cuda.max_memory_allocated()`` per phase (check_memory.py);
5. te (optional): the Transformer Engine layer spec, when TE is importable: HF-direct load
   bit-equal to the converted checkpoint, log-probs within bf16 bounds of the local spec (check_te.py);
6. sglang (optional): one tiny colocated SGLang engine, when ``$SGLANG_PYTHON`` (default this
   interpreter) imports sglang: release → resume → push (disk, then distributed over NCCL) →
   resume → generate, its log-probs against the trainer's at T = 0.7 (check_sglang.py).

An optional check that cannot run prints one line naming what is missing and counts as skipped,
not passed; the summary line names what was proven and what was not.

Each runs as its own process under what is left of ``--budget`` (default 450 s, inside the
8 minutes the acceptance allows), its output appended to ``<logs>/gpu_check.log`` and its
result to ``<logs>/gpu_check.json`` (``--logs DIR``, default the work directory). The last
line is ``gpu_ok=<0|1> tokens_per_s=<float> mfu=<float>``; gpu_ok is 1 only when all four
passed on CUDA. ``--device cpu`` runs the same checks on the CPU over gloo with small sizes (the
test suite does); it proves the checks, not a GPU, so it prints gpu_ok=0 and exits 0 when they
pass. Exit status: 0 all checks passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from check_lines import ROOT, exit_on_sigterm, run_process_group, select_device  # noqa: E402

CHECKS = ("parity", "train", "throughput", "memory")
OPTIONAL = ("te", "sglang")  # run when their packages are importable, else skipped in one line
# Seconds each step may take at most (less when the budget runs short).
TIMEOUTS = {"prepare": 180, "parity": 180, "train": 330, "throughput": 240, "memory": 150, "te": 120, "sglang": 300}
# Throughput sizes, and the --device cpu sizes: the same code paths in seconds on two cores.
CPU_TRAIN = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=16"]
GPU_BENCH = {"shape": "qwen2.5-0.5b", "seq_len": 4096, "batch": 8, "steps": 5, "warmup": 2}
CPU_BENCH = {"shape": "tiny", "seq_len": 64, "batch": 2, "steps": 2, "warmup": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "armor_gpu_check"))
    p.add_argument("--logs", default=None, help="where gpu_check.log/.json go (default: --work)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything")
    every = CHECKS + OPTIONAL
    p.add_argument("--only", default=",".join(every), help="comma-separated subset of " + ",".join(every))
    p.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up of the tiny model (150; cpu 20)")
    p.add_argument("--shape", default=None, help="throughput model shape (qwen2.5-0.5b; cpu: tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="throughput sequence length (4096; cpu: 64)")
    p.add_argument("--bench-batch", type=int, default=None, help="throughput sequences per step (8; cpu: 2)")
    p.add_argument("--bench-steps", type=int, default=None, help="throughput timed steps (5; cpu: 2)")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE", help="for armor-train")
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(every))
    if unknown or not only:
        p.error(f"--only: unknown check(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(every)}")
    args.only = only
    return args


class Runner:
    """Runs each step as a child process within the budget; keeps the log and the results."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget
        logs = args.logs or args.work
        os.makedirs(logs, exist_ok=True)
        self.log_path = os.path.join(logs, "gpu_check.log")
        self.json_path = os.path.join(logs, "gpu_check.json")
        open(self.log_path, "w").close()
        self.results: dict[str, dict] = {}

    def run(self, name: str, script: str, *flags: str) -> dict:
        """``python <script> --json ... <flags>``; its result record, or a failed one naming why."""
        left = self.deadline - time.monotonic()
        timeout = min(TIMEOUTS[name], left - 5)
        result_path = os.path.join(self.args.work, f"{name}.result.json")
        if os.path.exists(result_path):
            os.remove(result_path)
        if timeout < 10:
            return self.record(name, {"name": name, "ok": False, "line": f"{name}: ok=0 skipped: the budget is spent"})
        cmd = [sys.executable, os.path.join(HERE, script), "--json", result_path, "--device", self.args.device, *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        started = time.monotonic()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {name}: {' '.join(cmd)}\n")
            log.flush()
            code = run_process_group(cmd, timeout, stdout=log, stderr=subprocess.STDOUT, env=env)
            log.write(f"===== {name}: exit {code}, {time.monotonic() - started:.1f} s\n")
        if os.path.exists(result_path):
            with open(result_path) as f:
                return self.record(name, json.load(f))
        why = f"timed out after {timeout:.0f} s" if code is None else f"exited {code}: {self._last_log_line()}"
        return self.record(name, {"name": name, "ok": False, "line": f"{name}: ok=0 {why}"})

    def _last_log_line(self) -> str:
        with open(self.log_path) as f:
            lines = [line.strip() for line in f if line.strip() and not line.startswith("=====")]
        return lines[-1][:300] if lines else "no output"

    def record(self, name: str, result: dict) -> dict:
        self.results[name] = result
        with open(self.json_path, "w") as f:
            json.dump(self.results, f, indent=1)
        return result


def environment_line(device: str) -> str:
    from importlib import metadata

    import torch

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    packages = ", ".join(
        f"{d} {version(d)}" for d in ("megatron-core", "transformers", "transformer-engine", "math-verify")
    )
    return (
        f"gpu_check: device {device} (GPU: {gpu}), python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{packages}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    cpu = args.device == "cpu"
    os.makedirs(args.work, exist_ok=True)
    try:
        select_device(args.device)
        print(environment_line(args.device), flush=True)
    except RuntimeError as err:
        print(f"gpu_check: {err}", flush=True)
        print("gpu_ok=0 tokens_per_s=nan mfu=nan", flush=True)
        return 1
    runner = Runner(args)
    warmup = args.warmup_steps if args.warmup_steps is not None else (20 if cpu else 150)
    exit_on_sigterm()
    try:
        run_checks(args, runner, warmup)
    except SystemExit as stop:  # SIGTERM (the shell script's hard stop): the running check was stopped
        for name in (n for n in args.only if n not in runner.results):
            stopped = runner.record(name, {"name": name, "ok": False, "line": f"{name}: ok=0 stopped ({stop.code})"})
            print(stopped["line"], flush=True)
    passed = [n for n in args.only if runner.results[n]["ok"]]
    skipped = [n for n in args.only if runner.results[n].get("skipped")]
    proven = [n for n in passed if n not in skipped]
    bench = runner.results.get("throughput", {})
    gpu_ok = not cpu and all(n in proven for n in CHECKS)
    print(
        f"gpu_check: {len(passed)}/{len(args.only)} checks passed on {args.device}; log {runner.log_path}", flush=True
    )
    print(f"gpu_check: {summary(args, runner.results)}", flush=True)
    print(
        f"gpu_ok={int(gpu_ok)} tokens_per_s={_num(bench.get('tokens_per_s'), '.1f')} mfu={_num(bench.get('mfu'), '.4g')}",
        flush=True,
    )
    return 0 if len(passed) == len(args.only) else 1


def run_checks(args, runner: Runner, warmup: int) -> None:
    """prepare (when parity or train runs), then each check of ``--only``, printing its line."""
    cpu = args.device == "cpu"

    def size(value, key: str) -> str:
        return str(value if value is not None else (CPU_BENCH if cpu else GPU_BENCH)[key])

    prepared = {"ok": True}
    if {"parity", "train"} & set(args.only):
        prepared = runner.run("prepare", "check_train.py", "--work", args.work, "--prepare", f"--warmup-steps={warmup}")
        if not prepared["ok"]:
            print(prepared["line"], flush=True)
    for name in args.only:
        if name in ("parity", "train") and not prepared["ok"]:
            result = runner.record(name, {"name": name, "ok": False, "line": f"{name}: ok=0 not run: prepare failed"})
        elif name == "parity":
            result = runner.run(name, "check_parity.py", "--hf", os.path.join(args.work, "hf"), "--work", args.work)
        elif name == "train":
            overrides = (CPU_TRAIN if cpu else []) + args.train_override
            result = runner.run(name, "check_train.py", "--work", args.work, *overrides)
        elif name == "memory":
            result = runner.run(name, "check_memory.py")
        elif name in OPTIONAL:
            hf = os.path.join(args.work, "hf")
            if not os.path.isdir(hf):  # the tiny model of `prepare` (run when parity or train is asked)
                prepared = runner.run(
                    "prepare", "check_train.py", "--work", args.work, "--prepare", f"--warmup-steps={warmup}"
                )
            result = runner.run(name, f"check_{name}.py", "--hf", hf, "--work", args.work)
        else:
            result = runner.run(
                name,
                "check_throughput.py",
                f"--shape={size(args.shape, 'shape')}",
                f"--seq-len={size(args.seq_len, 'seq_len')}",
                f"--batch={size(args.bench_batch, 'batch')}",
                f"--steps={size(args.bench_steps, 'steps')}",
                f"--warmup={size(None, 'warmup')}",
            )
        print(result["line"], flush=True)


def summary(args, results: dict) -> str:
    """What this run proved on its device, and what it did not (failed, skipped with why, not asked)."""
    proven = [n for n in args.only if results[n]["ok"] and not results[n].get("skipped")]
    failed = [n for n in args.only if not results[n]["ok"]]
    skipped = [f"{n} ({results[n]['line'].split('skipped: ', 1)[-1]})" for n in args.only if results[n].get("skipped")]
    absent = [n for n in CHECKS + OPTIONAL if n not in args.only]
    parts = [f"proven on {args.device}: {', '.join(proven) or 'nothing'}"]
    if failed:
        parts.append(f"failed: {', '.join(failed)}")
    if skipped or absent:
        parts.append("not proven: " + ", ".join(skipped + [f"{n} (not asked)" for n in absent]))
    return "; ".join(parts)


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and math.isfinite(value) else "nan"


if __name__ == "__main__":
    sys.exit(main())
