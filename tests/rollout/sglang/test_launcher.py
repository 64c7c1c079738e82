"""The launcher starting real server processes: the SGLang TEST DOUBLE stands in for sglang.launch_server."""

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from armor_megatron.rollout.engine import EngineUnavailableError, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang import launcher as launcher_module
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher
from armor_megatron.rollout.testing.tiny_models import encode
from tests.processes import stopped_after

from .conftest import FAST_RETRY

TEST_SERVER = "armor_megatron.rollout.testing.sglang_test_server"


def test_commands_follow_sglang_flags():
    cfg = LauncherConfig(
        model_path="/m", num_engines=2, tp_size=4, base_port=30000, api_key="k", colocated=True, use_router=True
    )
    launcher = SGLangLauncher(cfg)
    cmd = launcher.server_command(1, 30001)
    # the key travels in $ARMOR_ENGINE_API_KEY through the launcher's wrapper, never on a command line
    assert cmd[1:4] == ["-m", "armor_megatron.rollout.sglang.launcher", "sglang.launch_server"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags["--tp-size"] == "4" and flags["--base-gpu-id"] == "4" and flags["--host"] == "127.0.0.1"
    assert "--api-key" not in cmd and "k" not in cmd and "--enable-memory-saver" in cmd
    launcher.ports = [30000, 30001]
    router = launcher.router_command(31000)
    assert router[3] == "sglang_router.launch_router" and "--api-key" not in router
    assert "--disable-health-check" in router  # colocated: no /health probe may reach a released engine
    disaggregated = SGLangLauncher(LauncherConfig(model_path="/m", use_router=True))
    disaggregated.ports = [30000]
    assert "--disable-health-check" not in disaggregated.router_command(31000)
    assert SGLangLauncher(LauncherConfig(model_path="/m")).server_command(0, 1)[1:3] == ["-m", "sglang.launch_server"]
    assert router[router.index("--worker-urls") + 1 :][:2] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert "--enable-deterministic-inference" not in cmd
    deterministic = SGLangLauncher(LauncherConfig(model_path="/m", deterministic=True)).server_command(0, 1)
    assert "--enable-deterministic-inference" in deterministic


def test_temperature_one_logprobs_are_refused():
    # the trainer computes log-probs at the sampling temperature, as SGLang reports them by default
    with pytest.raises(ValueError, match="env sets SGLANG_RETURN_ORIGINAL_LOGPROB"):
        LauncherConfig(model_path="/m", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_port_taken_before_the_server_binds_it_moves_the_server(tiny_ckpt, tmp_path, monkeypatch):
    from tests.rollout.test_local import teacher_forced_logprobs

    path, _, tok = tiny_ckpt
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = launcher_module.free_port
    monkeypatch.setattr(launcher_module, "free_port", lambda host: next(ports, None) or real(host))
    # inherited from the trainer's environment: not passed on (the double would report T=1 values)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    cfg = LauncherConfig(model_path=path, server_module=TEST_SERVER, log_dir=str(tmp_path), startup_timeout=120)
    launcher = SGLangLauncher(cfg)
    try:
        engine = SGLangEngine.launch(launcher, retry=FAST_RETRY)
        assert launcher.ports[0] != taken.getsockname()[1]
        assert "Address already in use" in (tmp_path / "engine-0.log").read_text()
        prompt = encode(tok, "12")
        sample = engine.generate([prompt], 1, SamplingParams(max_new_tokens=6, temperature=0.7, ignore_eos=True))[0][0]
        model = LocalEngine.from_pretrained(path).model
        expected = teacher_forced_logprobs(model, prompt, sample.token_ids, temperature=0.7)
        assert list(sample.logprobs) == pytest.approx(expected.tolist(), abs=1e-5)
        engine.shutdown()
    finally:
        launcher.stop()
        taken.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_engines_round_robin_with_api_key_then_clean_stop(tiny_ckpt, tmp_path):
    path, _, tok = tiny_ckpt
    cfg = LauncherConfig(
        model_path=path,
        num_engines=2,
        api_key="secret",
        server_module=TEST_SERVER,
        log_dir=str(tmp_path),
        startup_timeout=120,
    )
    launcher = SGLangLauncher(cfg)
    engine = SGLangEngine.launch(launcher, retry=FAST_RETRY)
    try:
        assert engine.weight_version == "default" and len(engine.workers) == 2
        groups = engine.generate([encode(tok, f"{i}") for i in range(4)], 2, SamplingParams(max_new_tokens=3))
        assert [len(g) for g in groups] == [2] * 4
        procs = list(launcher._procs)
        for p in procs:  # what `ps` shows to every user of the node
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                assert b"secret" not in f.read()
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in procs)
    assert not launcher.running


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_that_dies_at_startup_is_a_clear_error(tmp_path):
    cfg = LauncherConfig(
        model_path=str(tmp_path / "missing"), server_module=TEST_SERVER, log_dir=str(tmp_path), startup_timeout=100
    )
    with pytest.raises(EngineUnavailableError, match="exited with code 1; log tail"):
        SGLangLauncher(cfg).start()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_the_servers(tiny_ckpt, tmp_path):
    # A trainer process that launches a server and is then SIGTERMed must take the server down with it.
    path, _, _ = tiny_ckpt
    script = textwrap.dedent(
        f"""
        import sys, time
        from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher
        launcher = SGLangLauncher(LauncherConfig(model_path={path!r}, server_module={TEST_SERVER!r}, startup_timeout=120))
        launcher.start()
        print(launcher._procs[0].pid, flush=True)
        time.sleep(120)
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    with stopped_after(trainer):
        server_pid = int(trainer.stdout.readline())
        trainer.send_signal(signal.SIGTERM)
        # 143 from the launcher's handler; -15 when it chains to an earlier handler that re-raises the
        # signal (coverage's, in runs that measure subprocesses): terminated by SIGTERM either way
        assert trainer.wait(timeout=60) in (128 + signal.SIGTERM, -signal.SIGTERM)
    assert _gone(server_pid, within=60.0)


def _gone(pid, within):
    """Whether ``pid`` exits within ``within`` seconds (its pidfd turns readable on exit: no polling)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], within)[0])
    finally:
        os.close(pidfd)
