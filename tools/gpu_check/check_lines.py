"""What every check of ``tools/gpu_check`` shares: the repository on ``sys.path``, the device
choice, a free port, and the result record (one printed line + a JSON file for the driver).

A check is a script run as its own process (``python tools/gpu_check/check_<name>.py --json PATH
...``): a hang, a CUDA error or an out-of-memory in one check cannot take the others down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICES = ("cuda", "cpu")


def select_device(device: str) -> None:
    """Make `device` the one the package picks: it uses CUDA whenever ``torch.cuda.is_available()``
    (megatron/dist.py, megatron/model.py), so a CPU run on a GPU machine hides the GPUs. Call
    before torch is imported; raises when CUDA is asked for and absent."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device (use --device cpu for the CPU run)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env(port: int | None = None) -> None:
    """World size 1 for ``megatron.dist.initialize`` (its "single" launcher) on a port nobody holds."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(key, None)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so a check being stopped stops its own children first."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_process_group(cmd: list[str], timeout: float, **popen_kwargs) -> int | None:
    """Run `cmd` in a process group of its own and return its exit code, or None when it ran past
    `timeout`. On a timeout, or when the caller is interrupted, the group is stopped: SIGTERM
    (a check then stops its own children), SIGKILL after 10 s, to whatever of it is left."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return None
    except BaseException:
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def report(json_path: str | None, name: str, ok: bool, line: str, **values) -> None:
    """Print the check's one line (``<name>: ok=<0|1> ...``) and write it with `values` as JSON."""
    text = f"{name}: ok={int(ok)} {line}"
    print(text, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"name": name, "ok": bool(ok), "line": text, **values}, f)


def skipped_or_ready(json_path: str | None, name: str, why: str | None, device: str) -> bool:
    """An optional check's start: report it skipped when ``why`` names what is missing (True),
    else select ``device`` and a world-size-1 rendezvous (False)."""
    if why:
        report(json_path, name, True, f"skipped: {why}", skipped=True)
        return True
    select_device(device)
    single_process_env()
    return False


def model_check_parser(doc: str):
    """The flags every check on the tiny model takes: ``--hf``, ``--work``, ``--device``, ``--json``."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF checkpoint directory")
    p.add_argument("--work", required=True, help="scratch directory")
    p.add_argument("--device", default="cuda", choices=DEVICES)
    p.add_argument("--json", default=None, help="write the result here")
    return p
