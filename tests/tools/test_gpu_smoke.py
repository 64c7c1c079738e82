"""tools/gpu_smoke.sh on CPU: the SGLang TEST DOUBLE (not SGLang) stands in for
``sglang.launch_server``, importable only by the interpreter given as SGLANG_PYTHON, as in the
two-environment layout (docs/gpu.md, "GPU environments"): the server starts from that interpreter, the
client tests run from PYTHON."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_smoke.sh")
FAKE_LAUNCH_SERVER = """# the SGLang TEST DOUBLE, not SGLang
import os, sys
if "SGLANG_RETURN_ORIGINAL_LOGPROB" in os.environ:  # SGLang would answer with temperature-1 log-probs
    sys.exit("SGLANG_RETURN_ORIGINAL_LOGPROB reached the server")
from armor_megatron.rollout.testing.sglang_test_server import main
main()
"""
SERVER_PYTHON = """#!/bin/bash
echo "$*" >> "$SERVER_PYTHON_LOG"
export PYTHONPATH="$FAKE_SGLANG_DIR${PYTHONPATH:+:$PYTHONPATH}"
exec "$REAL_PYTHON" "$@"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def smoke(tmp_path):
    """run(**env) -> (returncode, stdout, stderr) of gpu_smoke.sh with the double behind SGLANG_PYTHON."""
    fakes = tmp_path / "fakes" / "sglang"
    fakes.mkdir(parents=True)
    (fakes / "__init__.py").write_text("")
    (fakes / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    wrapper = tmp_path / "sglang-python"
    wrapper.write_text(SERVER_PYTHON)
    wrapper.chmod(0o755)
    log = tmp_path / "server_python.log"

    def run(*pytest_args, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ARMOR_SGLANG_", "SGLANG_"))}
        env.update(
            PYTHON=sys.executable,
            REAL_PYTHON=sys.executable,
            FAKE_SGLANG_DIR=str(tmp_path / "fakes"),
            SERVER_PYTHON_LOG=str(log),
            SGLANG_PORT=str(free_port()),
            SMOKE_TIMEOUT="120",
            OMP_NUM_THREADS="1",
            **extra,
        )
        proc = subprocess.Popen(
            ["bash", SCRIPT, *pytest_args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:  # SIGTERM: the script's trap stops the server it started
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
        return proc.returncode, out, err

    run.server_python_calls = lambda: log.read_text().splitlines() if log.exists() else []
    run.wrapper = str(wrapper)
    return run


@pytest.mark.slow  # starts a server and a pytest process: ~20 s
@pytest.mark.timeout(300)
def test_the_server_runs_from_sglang_python_and_the_tests_from_python(smoke):
    tests = "n_samples_per_prompt or logprobs_are_at_the_sampling_temperature"
    rc, out, err = smoke("-k", tests, SGLANG_PYTHON=smoke.wrapper, SGLANG_RETURN_ORIGINAL_LOGPROB="1")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "2 passed" in out
    assert any(call.startswith("-m sglang.launch_server --model-path") for call in smoke.server_python_calls())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="this interpreter has sglang")
@pytest.mark.timeout(120)
def test_without_sglang_python_a_trainer_interpreter_lacking_sglang_is_one_clear_error(smoke):
    rc, _, err = smoke()
    assert rc == 2 and smoke.server_python_calls() == []
    assert err.strip().splitlines()[-1] == (
        f"gpu_smoke: sglang is not importable by {sys.executable}: set SGLANG_PYTHON to the SGLang "
        'environment\'s interpreter (docs/gpu.md, "GPU environments")'
    )
