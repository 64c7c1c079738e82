"""The batch template run by bash with SLURM faked: stub srun/scontrol on PATH, a fake trainer."""

import glob
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launch.conftest import ROOT, consecutive_free_ports

TEMPLATE = os.path.join(ROOT, "tools", "slurm", "armor.sbatch")
SHELL_SCRIPTS = sorted(
    glob.glob(os.path.join(ROOT, "tools", "slurm", "*.sbatch"))
    + glob.glob(os.path.join(ROOT, "tools", "slurm", "*.sh"))
    + glob.glob(os.path.join(ROOT, "examples", "*", "*.sh"))
)
PY = sys.executable

SRUN_STUB = """#!/bin/bash
echo "srun $*" >> "$STUB_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""
SCONTROL_STUB = """#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
if [[ $1 == show && $2 == hostnames ]]; then exec "$ARMOR_PYTHON" -m armor_megatron.cli.slurm hostnames "$3"; fi
"""
FAKE_TRAINER = """
import os, signal, sys, time
log = os.environ["FAKE_LOG"]
def note(text):
    with open(log, "a") as f:
        f.write(text + "\\n")
note("argv " + " ".join(sys.argv[1:]))
mode = os.environ["FAKE_MODE"]
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
def on_usr1(signum, frame):
    note("got USR1")
    sys.exit(int(os.environ.get("FAKE_EXIT_ON_USR1", "85")))
signal.signal(signal.SIGUSR1, on_usr1)
open(log + ".ready", "w").close()
time.sleep(60)
sys.exit(9)
"""
# A stand-in for `python -m sglang.launch_server` (test double, not SGLang): answers /health_generate.
FAKE_SGLANG = """
import argparse, http.server, os
if "SGLANG_RETURN_ORIGINAL_LOGPROB" in os.environ:  # SGLang would answer with temperature-1 log-probs
    raise SystemExit("SGLANG_RETURN_ORIGINAL_LOGPROB reached the engine")
p = argparse.ArgumentParser()
p.add_argument("--port", type=int); p.add_argument("--host")
args, _ = p.parse_known_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((args.host, args.port), H).serve_forever()
"""


@pytest.fixture
def job(tmp_path):
    """Run the template as SLURM would, with stubs; returns run(args, mode=..., **env) -> CompletedProcess."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "fakes" / "sglang").mkdir(parents=True)
    (tmp_path / "fakes" / "sglang" / "__init__.py").write_text("")
    (tmp_path / "fakes" / "sglang" / "launch_server.py").write_text(FAKE_SGLANG)

    class Job:
        stub_log = tmp_path / "stub.log"
        trainer_log = tmp_path / "trainer.log"

        def env(self, mode="exit0", with_stubs=True, **extra):
            path = os.pathsep.join(([str(bin_dir)] if with_stubs else []) + [os.path.dirname(PY), "/usr/bin", "/bin"])
            env = {
                "PATH": path,
                "HOME": str(tmp_path),
                "ARMOR_HOME": ROOT,
                "ARMOR_PYTHON": PY,
                "ARMOR_TRAIN_ENTRY": f"{shlex.quote(PY)} {shlex.quote(str(tmp_path / 'fake_trainer.py'))}",
                "PYTHONPATH": str(tmp_path / "fakes"),
                "STUB_LOG": str(self.stub_log),
                "FAKE_LOG": str(self.trainer_log),
                "FAKE_MODE": mode,
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NODELIST": "cpu01",
                "SLURM_JOB_NUM_NODES": "1",
            }
            env.update(extra)
            return env

        def run(self, args, **env):
            return subprocess.run(
                ["bash", TEMPLATE, *args], cwd=ROOT, env=self.env(**env), capture_output=True, text=True, timeout=60
            )

        def start(self, args, **env):
            return subprocess.Popen(
                ["bash", TEMPLATE, *args],
                cwd=ROOT,
                env=self.env(**env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        def scontrol_calls(self):
            text = self.stub_log.read_text() if self.stub_log.exists() else ""
            return [line for line in text.splitlines() if line.startswith("scontrol")]

        def wait_ready(self, timeout=30):
            deadline = time.monotonic() + timeout
            while not os.path.exists(str(self.trainer_log) + ".ready"):
                assert time.monotonic() < deadline, "fake trainer never started"
                time.sleep(0.05)

    return Job()


def test_every_shell_script_parses():
    assert TEMPLATE in SHELL_SCRIPTS
    for path in SHELL_SCRIPTS:
        result = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{path}: {result.stderr}"


TWO_NODES = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.slow  # a simulated job: seconds each
def test_dry_run_prints_the_exact_commands_of_a_two_node_colocated_job(job):
    # one policy engine and the frozen reference's engine (anchor.source: separate)
    args = [
        "--dry-run",
        "--config",
        "configs/qwen3_30b_a3b_moe_armor.yaml",
        "rollout.sglang.num_engines=1",
        "rollout.sglang.mem_fraction_static=0.7",
    ]
    out = job.run(
        args,
        with_stubs=False,
        ARMOR_TRAIN_ENTRY="python -m armor_megatron.cli.train",
        ARMOR_PYTHON="python",
        **TWO_NODES,
    )
    assert out.returncode == 0, out.stderr
    engine = (
        "srun --overlap --nodes=1 --ntasks=1 --nodelist={node} env -u SGLANG_RETURN_ORIGINAL_LOGPROB "
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false python -m sglang.launch_server "
        "--model-path /models/Qwen3-30B-A3B-Base --tp-size 4 --base-gpu-id {gpu} --host 0.0.0.0 --port {port} "
        "--mem-fraction-static 0.7 --dtype bfloat16 --random-seed {seed} --enable-memory-saver &"
    )
    assert out.stdout.splitlines() == [
        "# dry run of qwen3-30b-a3b-armor, job 4242 on node01 node02: commands in order, none executed",
        "export MASTER_ADDR=node01 MASTER_PORT=24242",
        engine.format(node="node01", gpu=0, port=30000, seed=0),
        engine.format(node="node01", gpu=4, port=30001, seed=1),
        "python -m armor_megatron.cli.slurm wait-engines --timeout 1800 --pid <engine steps> http://node01:30000 http://node01:30001",
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --nodelist=node01,node02 --kill-on-bad-exit=1 --overlap "
        "python -m armor_megatron.cli.train --config configs/qwen3_30b_a3b_moe_armor.yaml "
        "rollout.sglang.num_engines=1 rollout.sglang.mem_fraction_static=0.7 'rollout.sglang.urls=[\"http://node01:30000\"]' "
        "'anchor.reference_urls=[\"http://node01:30001\"]'",
        "# on exit 85 (or a failure after SIGUSR1): scontrol requeue 4242",
    ]


@pytest.mark.slow  # a simulated job: seconds each
def test_dry_run_of_a_two_node_torchrun_job_uses_scontrol_for_the_node_list(job):
    args = ["--launcher", "torchrun", "--config", "configs/tiny_cpu.yaml", "launch.nodes=2", "launch.gpus_per_node=4"]
    out = job.run(
        args,
        ARMOR_DRY_RUN="1",
        ARMOR_TRAIN_ENTRY="python -m armor_megatron.cli.train",
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="gpu[7-8]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_PER_NODE="4",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2] == (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=gpu7,gpu8 --kill-on-bad-exit=1 "
        "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=gpu7:20077 --rdzv-id=77 "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=120 "
        "-m armor_megatron.cli.train --config configs/tiny_cpu.yaml launch.nodes=2 launch.gpus_per_node=4"
    )
    assert job.scontrol_calls() == ["scontrol show hostnames gpu[7-8]"]  # dry run: no requeue, no srun
    assert "srun" not in (job.stub_log.read_text())


@pytest.mark.slow  # a simulated job: seconds each
def test_bad_config_fails_with_one_line_before_running_anything(job):
    out = job.run(["--config", "configs/tiny_cpu.yaml", "algorithm.alpha=2"])
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1]
        == "armor-slurm: error: algorithm.alpha: 2.0 is out of range, must be in (0, 1]"
    )
    assert not job.trainer_log.exists()


@pytest.mark.slow
def test_the_job_refuses_a_layout_over_the_gpu_memory_unless_no_plan(job):
    args = ["--dry-run", "--config", "configs/qwen25_math_7b_dapo_armor.yaml", "train.recompute=none"]
    env = dict(with_stubs=False, ARMOR_PYTHON="python", SLURM_GPUS_ON_NODE="8")
    out = job.run(args, **env)
    assert out.returncode == 2 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("armor-slurm: error: plan: tp=2 pp=1 dp=4") and last.endswith("pass --no-plan to accept it")
    accepted = job.run([*args, "--no-plan"], **env)
    assert accepted.returncode == 0, accepted.stderr
    assert "--no-plan" not in accepted.stdout.splitlines()[-2]  # the trainer's own arguments do not take it


@pytest.mark.slow  # a simulated job: seconds each
@pytest.mark.parametrize("mode, rc, requeued", [("exit85", 85, True), ("exit0", 0, False), ("exit3", 3, False)])
def test_requeue_exit_code_leads_to_scontrol_requeue(job, mode, rc, requeued):
    out = job.run(["--config", "configs/tiny_cpu.yaml"], mode=mode)
    assert out.returncode == rc, out.stderr
    assert job.trainer_log.read_text().splitlines()[0] == "argv --config configs/tiny_cpu.yaml"
    expected = ["scontrol show hostnames cpu01"] + (["scontrol requeue 4242"] if requeued else [])
    assert job.scontrol_calls() == expected


@pytest.mark.slow  # a simulated job: seconds each
def test_configured_requeue_exit_code_is_the_one_that_counts(job):
    out = job.run(["--config", "configs/tiny_cpu.yaml", "launch.requeue_exit_code=42"], mode="exit85")
    assert out.returncode == 85 and "scontrol requeue 4242" not in job.scontrol_calls()
    out = job.run(["--config", "configs/tiny_cpu.yaml", "launch.requeue_exit_code=42"], mode="exit42")
    assert out.returncode == 42 and job.scontrol_calls()[-1] == "scontrol requeue 4242"


@pytest.mark.slow  # a simulated job: seconds each
def test_requeue_stops_after_max_requeues(job):
    out = job.run(["--config", "configs/tiny_cpu.yaml"], mode="exit85", SLURM_RESTART_COUNT="3", ARMOR_MAX_REQUEUES="3")
    assert out.returncode == 85 and "scontrol requeue 4242" not in job.scontrol_calls()
    assert "not requeueing: the job was already restarted 3 times" in out.stderr


@pytest.mark.slow  # a simulated job: seconds each
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exit_on_usr1", ["85", "1"])
def test_time_limit_signal_is_forwarded_and_the_job_requeued(job, exit_on_usr1):
    # SLURM's --signal=B:USR1@120 reaches the batch shell; the template forwards it to the trainer.
    # A trainer that checkpoints exits 85; one whose code is lost (torchrun) or that fails exits 1:
    # both come back, from the latest complete checkpoint.
    proc = job.start(["--config", "configs/tiny_cpu.yaml"], mode="wait", FAKE_EXIT_ON_USR1=exit_on_usr1)
    try:
        job.wait_ready()
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == int(exit_on_usr1), err
    assert "got USR1" in job.trainer_log.read_text()
    assert job.scontrol_calls()[-1] == "scontrol requeue 4242"


@pytest.mark.slow  # a simulated job: seconds each
@pytest.mark.timeout(90)
def test_engines_start_before_the_trainer_and_stop_after_it(job):
    port = consecutive_free_ports(2)  # the policy engine's and the frozen reference's
    args = [
        "--config",
        "configs/qwen25_math_7b_dapo_armor.yaml",
        f"rollout.sglang.base_port={port}",
        "rollout.sglang.num_engines=1",
        "rollout.sglang.tp_per_engine=1",
    ]
    # srun hands the job's environment to the engine steps; the engine command drops this one
    out = job.run(args, mode="exit0", SLURM_GPUS_ON_NODE="8", SGLANG_RETURN_ORIGINAL_LOGPROB="1")
    assert out.returncode == 0, out.stderr
    argv = job.trainer_log.read_text().splitlines()[0]
    assert argv.endswith(
        f'rollout.sglang.urls=["http://127.0.0.1:{port}"] anchor.reference_urls=["http://127.0.0.1:{port + 1}"]'
    )
    assert "2 engine(s) healthy" in out.stderr  # the policy engine and the frozen reference's
    for engine_port in (port, port + 1):
        with pytest.raises(OSError):  # the engine steps were stopped when the trainer finished
            socket.create_connection(("127.0.0.1", engine_port), timeout=1).close()


@pytest.mark.slow  # a simulated job: seconds each
@pytest.mark.timeout(90)
def test_an_engine_that_dies_fails_the_job_without_starting_the_trainer(job, tmp_path):
    (tmp_path / "fakes" / "sglang" / "launch_server.py").write_text("raise SystemExit('no GPU here')\n")
    out = job.run(
        ["--config", "configs/qwen25_math_7b_dapo_armor.yaml", f"rollout.sglang.base_port={consecutive_free_ports(2)}"],
        SLURM_GPUS_ON_NODE="8",
    )
    assert out.returncode == 1
    assert "exited before http://127.0.0.1:" in out.stderr and "engines did not start" in out.stderr
    assert not job.trainer_log.exists()
