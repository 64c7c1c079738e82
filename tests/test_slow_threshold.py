"""The slow-test rule of tests/conftest.py, run on a small suite of its own (pytest in a subprocess):
a test not marked slow that works past ``ARMOR_SLOW_TEST_SECONDS`` fails and is told to be marked;
one that only waited for a busy machine passes."""

import os
import re
import signal
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

HERE = os.path.dirname(os.path.abspath(__file__))

SUITE = """
import subprocess
import sys
import time

import pytest

BURN = "import time\\nend = time.process_time() + {s}\\nwhile time.process_time() < end: pass"


def burn(seconds):
    exec(BURN.format(s=seconds))


@pytest.fixture
def slow_setup():
    burn(0.8)


@pytest.fixture(scope="session")
def slow_shared():
    burn(0.8)


@pytest.fixture(scope="session")
def quick_shared():
    burn(0.15)


def test_quick():
    pass


def test_works_past_the_limit():
    burn(0.8)


def test_works_past_the_limit_in_a_child_process():
    subprocess.run([sys.executable, "-c", BURN.format(s=0.8)], check=True)


def test_slow_only_in_its_fixture(slow_setup):
    pass


def test_pays_for_no_shared_fixture_below_the_limit(quick_shared):
    burn(0.15)  # 0.3 s with its shared fixture


def test_works_below_the_limit():
    burn(0.35)  # on a core shared with two others, over 1 s of wall time


def test_sets_up_a_slow_shared_fixture(slow_shared):
    pass


def test_waiting_is_not_work():
    time.sleep(0.8)


@pytest.mark.slow
def test_marked_slow_may_take_long(slow_shared):
    burn(0.8)


def test_failing_slowly_keeps_its_own_failure():
    burn(0.8)
    assert False, "its own assertion"
"""


def _prepare(pytester, monkeypatch, limit):
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=SUITE)
    monkeypatch.setenv("ARMOR_SLOW_TEST_SECONDS", limit)


def _run(pytester, monkeypatch, limit, *args):
    _prepare(pytester, monkeypatch, limit)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args)


@pytest.mark.slow  # a pytest process of its own
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_test_over_the_limit_fails_unless_marked_slow(pytester, monkeypatch, workers):
    """The rule and the clock hold in one process and under pytest-xdist (the clock is printed by the
    controlling process, from the tests' reports)."""
    result = _run(pytester, monkeypatch, "0.5", *workers)
    result.assert_outcomes(passed=5, failed=5)
    out = result.stdout.str()
    for name in ("test_works_past_the_limit", "test_works_past_the_limit_in_a_child_process"):
        assert f"test_inner.py::{name} took" in out
    assert "test_inner.py::test_slow_only_in_its_fixture took" in out
    assert "test_inner.py::test_sets_up_a_slow_shared_fixture: its shared fixture 'slow_shared' took" in out
    assert "mark the tests that use it @pytest.mark.slow" in out
    assert "over the 0.5 s limit of a test not marked slow (ARMOR_SLOW_TEST_SECONDS): mark it @pytest.mark.slow" in out
    assert "its own assertion" in out and "test_failing_slowly_keeps_its_own_failure took" not in out
    assert "test_marked_slow_may_take_long took" not in out and "test_waiting_is_not_work took" not in out
    # the closing clock: the unmarked tests burn 4.65 s of CPU (the shared slow fixture counts in the test that
    # set it up), the marked one 0.8 s more; sleeping counts as wall time only
    clock = re.search(r"suite clock: 10 tests in (\S+) s wall, (\S+) s CPU; not marked slow: 9 tests, (\S+) s CPU", out)
    assert clock, out[-2000:]
    wall, cpu, unmarked = (float(x) for x in clock.groups())
    assert 4.6 <= unmarked <= cpu - 0.75 and wall >= 0.8


def _spin_on(core: int) -> int:
    """A process spinning on ``core`` that is not below this one (it counts as load, not as the test's CPU)."""
    spin = (
        "import os, sys\nif os.fork():\n    os._exit(0)\nos.setsid()\n"
        f"os.sched_setaffinity(0, {{{core}}})\nprint(os.getpid(), flush=True)\n"
        "null = os.open(os.devnull, os.O_RDWR)\nfor fd in (0, 1, 2):\n    os.dup2(null, fd)\nwhile True: pass"
    )
    out = subprocess.run([sys.executable, "-c", spin], capture_output=True, text=True, timeout=60)
    return int(out.stdout.split()[0])


@pytest.mark.slow  # a pytest process of its own
@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_busy_core_fails_no_test(pytester, monkeypatch):
    """The quick tests run on one core that two spinning processes also want: they wait, and pass."""
    _prepare(pytester, monkeypatch, "0.5")
    core = min(os.sched_getaffinity(0))
    hogs = [_spin_on(core) for _ in range(2)]
    try:
        run = (
            f"import os, sys, pytest\nos.sched_setaffinity(0, {{{core}}})\n"
            "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '-k', 'quick or below_the_limit or waiting']))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", run], cwd=pytester.path, capture_output=True, text=True, timeout=100
        )
    finally:
        for pid in hogs:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # a pytest process of its own
@pytest.mark.timeout(120)
def test_the_limit_is_set_by_the_environment(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0", "-k", "past_the_limit or slow_shared_fixture")  # 0: no limit
    result.assert_outcomes(passed=3)
    result = _run(pytester, monkeypatch, "soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ARMOR_SLOW_TEST_SECONDS='soon' is not a number of seconds*"])


def test_one_usable_core_doubles_the_default_limit(monkeypatch):
    from tests.conftest import SLOW_DEFAULT_S, SLOW_ENV, slow_limit_s

    monkeypatch.delenv(SLOW_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert slow_limit_s() == 2 * SLOW_DEFAULT_S  # taskset -c 0: a test's two ranks share the core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert slow_limit_s() == SLOW_DEFAULT_S
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setenv(SLOW_ENV, "7")
    assert slow_limit_s() == 7.0  # a limit that is set is taken as it is


CPU_TIME_CHECK = """
import subprocess, sys, time
from tests.conftest import cpu_seconds_since, cpu_snapshot

start = cpu_snapshot()
time.sleep(0.3)
assert cpu_seconds_since(start) < 0.2, cpu_seconds_since(start)  # waiting is not work
burn = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass\\ntime.sleep(30)"
child = subprocess.Popen([sys.executable, "-c", burn])
try:
    deadline = time.monotonic() + 30
    while cpu_seconds_since(start) < 0.5 and time.monotonic() < deadline:  # alive: read from /proc
        time.sleep(0.05)
    assert cpu_seconds_since(start) >= 0.5, cpu_seconds_since(start)
finally:
    child.kill()
    child.wait()
assert 0.5 <= cpu_seconds_since(start) < 5, cpu_seconds_since(start)  # reaped: in its parent's children's times, once
"""


def test_cpu_time_counts_this_process_and_the_processes_below_it():
    # in a process of its own: below pytest, the session's pooled ranks and servers may work at any time
    root = os.path.dirname(HERE)
    proc = subprocess.run([sys.executable, "-c", CPU_TIME_CHECK], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
