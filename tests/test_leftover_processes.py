"""The end-of-run check of tests/conftest.py, run on small suites of its own (pytest in a subprocess,
so only that session's children count)."""

import os

import psutil
import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow  # each runs a pytest process of its own (the pooled one starts ranks importing torch)

HERE = os.path.dirname(os.path.abspath(__file__))

LEAKY = """
import subprocess, sys

def test_starts_a_process_and_forgets_it(tmp_path_factory):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open({pid_file!r}, "w").write(str(proc.pid))
"""

TIDY = """
import multiprocessing

def _child():
    pass

def test_spawns_a_process_and_joins_it():
    # the spawn context starts multiprocessing's resource tracker, which lives as long as this process
    p = multiprocessing.get_context("spawn").Process(target=_child)
    p.start()
    p.join()
    assert p.exitcode == 0
"""

POOLED = """
import sys

import psutil

sys.path.insert(0, {repo!r})
from tests.megatron.spawn import run_ranks


def _square(rank, x):
    return x * x


def test_pooled_ranks_outlive_the_call():
    assert run_ranks(_square, 2, 3) == [9, 9]
    assert run_ranks(_square, 1, 4) == [16]  # the same processes serve the next call
    assert len([p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]) == 2
"""


def _suite(pytester, body):
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")


@pytest.mark.timeout(120)
def test_a_process_left_running_fails_the_run_and_is_killed(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("ARMOR_LEFTOVER_GRACE_SECONDS", "1")  # the sleeper never ends: no need to wait 10 s
    pid_file = str(tmp_path / "pid")
    result = _suite(pytester, LEAKY.format(pid_file=pid_file))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*1 process(es) started by the tests outlived them (killed now):*", "*time.sleep(120)*"]
    )
    pid = int(open(pid_file).read())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(120)
def test_lifetime_helpers_are_stopped_not_reported(pytester):
    result = _suite(pytester, TIDY)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "outlived" not in result.stdout.str()


@pytest.mark.timeout(180)
def test_pooled_ranks_are_stopped_at_the_end_not_reported(pytester):
    result = _suite(pytester, POOLED.format(repo=os.path.dirname(HERE)))
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "outlived" not in result.stdout.str()


LEFT_GROUP = """
import torch.distributed as dist


def test_starts_a_group_and_leaves_it(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


def test_after_it_in_the_same_module():
    assert dist.is_initialized()  # the check runs once the module is done
"""


@pytest.mark.timeout(120)
def test_a_process_group_left_by_a_module_fails_the_run_and_is_destroyed(pytester):
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_inner=LEFT_GROUP)
    pytester.makepyfile(
        test_later="import torch.distributed as dist\n\ndef test_no_group():\n    assert not dist.is_initialized()\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "test_inner.py", "test_later.py")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_inner left torch.distributed's default process group initialised*"])
