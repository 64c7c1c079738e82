import http.server
import os
import shlex
import socket
import subprocess
import sys
import threading

import pytest

from armor_megatron.cli.slurm import main
from armor_megatron.launch.health import EngineStartError, wait_for_engines
from tests.launch.conftest import ROOT

TINY = os.path.join("configs", "tiny_cpu.yaml")
QWEN7B = os.path.join("configs", "qwen25_math_7b_dapo_armor.yaml")


@pytest.fixture(autouse=True)
def repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_dry_run_outside_slurm_previews_placeholder_hosts(capsys):
    assert (
        main(["--config", "configs/llama3_70b_armor.yaml", "rollout.sglang.host=0.0.0.0", "--dry-run"], environ={}) == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# preview outside SLURM: job id 0, host names are placeholders"
    assert "# trainer: 4 node(s) x 8 process(es) = 32 ranks via srun; requeue exit code 85" in out
    assert "# engine 2 (policy): node07 GPUs 0,1,2,3,4,5,6,7 -> http://node07:30002" in out
    assert "# engine 3 (reference): node08 GPUs 0,1,2,3,4,5,6,7 -> http://node08:30003" in out


def test_shell_mode_needs_an_allocation(capsys):
    assert main(["plan", "--config", TINY, "--shell"], environ={}) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


def test_array_task_picks_its_config(tmp_path, capsys):
    (tmp_path / "3.yaml").write_text(open(TINY).read().replace("name: tiny-cpu-armor", "name: task-three"))
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "c1", "SLURM_ARRAY_TASK_ID": "3"}
    assert main(["plan", "--config", str(tmp_path / "%a.yaml"), "--shell"], environ=env) == 0
    out = capsys.readouterr().out
    assert "ARMOR_RUN_NAME=task-three" in out and f"--config {tmp_path}/3.yaml" in out
    assert (
        main(["plan", "--config", str(tmp_path / "%a.yaml"), "--shell"], environ={**env, "SLURM_ARRAY_TASK_ID": ""})
        == 2
    )
    env.pop("SLURM_ARRAY_TASK_ID")
    assert main(["plan", "--config", str(tmp_path / "%a.yaml"), "--shell"], environ=env) == 2
    assert "uses %a but SLURM_ARRAY_TASK_ID is not set" in capsys.readouterr().err


def test_submit_dry_run_prints_the_sbatch_command(capsys):
    env = {}
    args = [
        "submit",
        "--config",
        QWEN7B,
        "launch.partition=gpu",
        "launch.account=rl",
        'launch.time="12:00:00"',
        "--dry-run",
    ]
    assert main(args + ["--launcher", "torchrun", "--sbatch-arg=--qos=high", "--signal-grace", "300"], environ=env) == 0
    assert capsys.readouterr().out.strip() == (
        "sbatch --job-name=qwen25-math-7b-dapo-armor --nodes=1 --gpus-per-node=8 --exclusive --time=12:00:00 "
        "--partition=gpu --account=rl --requeue --signal=B:USR1@300 --export=ALL,ARMOR_SIGNAL_GRACE=300 "
        "--open-mode=append "
        "--output=runs/slurm/%x-%j.out --qos=high tools/slurm/armor.sbatch --launcher=torchrun "
        f"--config {QWEN7B} launch.partition=gpu launch.account=rl 'launch.time=\"12:00:00\"'"
    )


def test_submit_refuses_a_layout_that_cannot_start(capsys):
    assert (
        main(
            [
                "submit",
                "--config",
                "configs/qwen3_8b_base_two_stage.yaml",
                "rollout.sglang.host=127.0.0.1",
                "--dry-run",
            ],
            environ={},
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("armor-slurm: error: rollout.sglang.host=127.0.0.1: in a multi-node job")


def test_submit_without_sbatch_is_one_clear_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # never a real scheduler, whatever this host has
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", os.path.join(ROOT, QWEN7B)], environ={}) == 2
    assert "sbatch not found on PATH" in capsys.readouterr().err


def test_submit_runs_sbatch_and_creates_the_log_directory(capsys, monkeypatch, tmp_path):
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch.calls"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "Submitted batch job 7"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", os.path.join(ROOT, QWEN7B)], environ={}) == 0
    assert calls.read_text().startswith("--job-name=qwen25-math-7b-dapo-armor --nodes=1")
    assert (tmp_path / "runs" / "slurm").is_dir()  # SLURM does not create the directory of --output


@pytest.mark.slow  # a fresh interpreter importing the package
def test_module_runs_as_a_program():
    out = subprocess.run(
        [sys.executable, "-m", "armor_megatron.cli.slurm", "--config", TINY, "--dry-run"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith(
        "srun --nodes=1 --ntasks=2 --ntasks-per-node=2"
    )


# ---------------------------------------------------------------------------- engine health


class _Health(http.server.BaseHTTPRequestHandler):
    """An engine that answers 503 to its health checks before call ``healthy_from_call``, then 200
    (with the key). Each test serves its own subclass (`_health_server`), so no count leaks from one
    test into another."""

    calls = 0
    healthy_from_call = 2

    def do_GET(self):
        type(self).calls += 1
        ok = (
            self.path == "/health_generate"
            and type(self).calls >= type(self).healthy_from_call
            and self.headers.get("Authorization") == "Bearer k"
        )
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def _health_server(healthy_from_call: int = 2) -> http.server.HTTPServer:
    """A running `_Health` server of a fresh handler class (its own call count, from 0)."""
    handler = type("Health", (_Health,), {"calls": 0, "healthy_from_call": healthy_from_call})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown() waits <= 0.05 s
    return server


@pytest.mark.timeout(30)
def test_wait_for_engines_polls_until_healthy():
    server = _health_server()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        waited = wait_for_engines([url], timeout_s=20, api_key="k", poll_s=0.05)
        assert server.RequestHandlerClass.calls == 2 and waited < 20  # first answer 503, second 200
    finally:
        server.shutdown()


@pytest.mark.timeout(30)
def test_wait_for_engines_fails_fast_on_a_dead_engine_and_on_timeout():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with socket.socket() as closed:  # bound, never listening: connections are refused while we hold it
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(EngineStartError, match=f"engine step\\(s\\) {dead.pid} exited before {url}"):
            wait_for_engines([url], timeout_s=20, pids=[dead.pid], poll_s=0.05)
        with pytest.raises(EngineStartError, match="1 engine\\(s\\) not healthy after"):
            wait_for_engines([url], timeout_s=0.2, poll_s=0.05)


def test_plan_dry_run_never_prints_the_api_key(capsys):
    args = ["--config", QWEN7B, "rollout.sglang.api_key=s3cret", "--dry-run"]
    assert main(args, environ={}) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "export ARMOR_ENGINE_API_KEY=<redacted>" in out


@pytest.mark.timeout(30)
def test_wait_engines_takes_the_key_from_the_environment(capsys):
    server = _health_server(healthy_from_call=1)  # healthy at once: `armor-slurm` polls every 2 s
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert main(["wait-engines", "--timeout", "20", url], environ={"ARMOR_ENGINE_API_KEY": "k"}) == 0
    finally:
        server.shutdown()


NOT_FITTING = ["train.recompute=none"]  # the 7B recipe without recompute: its update needs more than 80 GiB


@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["plan", "--dry-run"]])
def test_a_layout_over_the_gpu_memory_is_refused_unless_no_plan(command, capsys):
    args = [*command, "--config", QWEN7B, *NOT_FITTING]
    assert main(args, environ={}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("armor-slurm: error: plan: tp=2 pp=1")
    assert "phase 'update' (colocated) > launch.gpu_memory_gib 80" in err and "--no-plan" in err
    assert main([*args, "--no-plan"], environ={}) == 0
    if command[0] == "submit":  # the job's own plan (tools/slurm/armor.sbatch) accepts it too
        assert shlex.split(capsys.readouterr().out)[-1] == "--no-plan"
