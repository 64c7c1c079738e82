"""`cli.relaunch.die_with_launcher`: a rank started in a session of its own (as torchrun's agent
starts them) dies with the launcher that started it, also when the launcher is killed outright."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from armor_megatron.cli import relaunch

# the launcher: names itself as armor-train's relaunch does, starts one "rank" in a session of its
# own, prints the rank's pid and waits
LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    os.environ[{pid_var!r}] = str(os.getpid())
    os.environ[{dir_var!r}] = {folder!r}
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(300)
    """
)
# the rank: asks to die with the launcher, then says so in a file and waits
RANK = (
    "import pathlib, sys, time; from armor_megatron.cli import relaunch; relaunch.die_with_launcher(); "
    "pathlib.Path({ready!r}).touch(); time.sleep(300)"
)


@pytest.fixture
def launched(tmp_path):
    ready = tmp_path / "ready"
    code = LAUNCHER.format(pid_var=relaunch.LAUNCHER_PID_VAR, dir_var=relaunch.STATUS_DIR_VAR, folder=str(tmp_path))
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, RANK.format(ready=str(ready))], stdout=subprocess.PIPE, text=True
    )
    rank = psutil.Process(int(launcher.stdout.readline()))
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert rank.is_running() and time.time() < deadline, "the rank never got ready"
            time.sleep(0.05)
        yield launcher, rank
    finally:
        for proc in (launcher, rank):
            try:
                proc.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        launcher.wait(timeout=30)


def test_a_rank_dies_when_its_launcher_is_killed_with_sigkill(launched):
    launcher, rank = launched
    assert os.getsid(rank.pid) != os.getsid(launcher.pid)  # a signal to the launcher's group misses it
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    rank.wait(timeout=30)  # psutil.TimeoutExpired here: the rank would train on without its launcher


def _exit_code(env):
    code = "from armor_megatron.cli import relaunch; relaunch.die_with_launcher(); raise SystemExit(7)"
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode


def test_only_a_rank_of_a_relaunch_ends_when_its_launcher_is_gone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (relaunch.LAUNCHER_PID_VAR, relaunch.STATUS_DIR_VAR)}
    gone = {relaunch.LAUNCHER_PID_VAR: "1"}  # not this process's parent
    assert _exit_code(env) == 7  # no launcher named: it returns
    assert _exit_code({**env, **gone}) == 7  # a launcher pid without the relaunch's status folder: not a rank
    assert _exit_code({**env, **gone, relaunch.STATUS_DIR_VAR: str(tmp_path)}) == relaunch.EXIT_LAUNCHER_GONE
