"""The slow-test rule of tests/conftest.py, run on a small suite of its own (pytest in a subprocess):
a test not marked slow that runs past ``ARMOR_SLOW_TEST_SECONDS`` fails and is told to be marked."""

import os

import pytest

pytest_plugins = ["pytester"]

HERE = os.path.dirname(os.path.abspath(__file__))

SUITE = """
import time

import pytest


@pytest.fixture
def slow_setup():
    time.sleep(0.8)


@pytest.fixture(scope="session")
def slow_shared():
    time.sleep(0.8)


@pytest.fixture(scope="session")
def quick_shared():
    time.sleep(0.15)


def test_quick():
    pass


def test_sleeps_past_the_limit():
    time.sleep(0.8)


def test_slow_only_in_its_fixture(slow_setup):
    pass


def test_pays_for_no_shared_fixture_below_the_limit(quick_shared):
    time.sleep(0.15)  # 0.3 s with its shared fixture


def test_sets_up_a_slow_shared_fixture(slow_shared):
    pass


@pytest.mark.slow
def test_marked_slow_may_take_long(slow_shared):
    time.sleep(0.8)


def test_failing_slowly_keeps_its_own_failure():
    time.sleep(0.8)
    assert False, "its own assertion"
"""


def _run(pytester, monkeypatch, limit, *args):
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=SUITE)
    monkeypatch.setenv("ARMOR_SLOW_TEST_SECONDS", limit)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args)


@pytest.mark.timeout(120)
def test_a_test_over_the_limit_fails_unless_marked_slow(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0.5")
    result.assert_outcomes(passed=3, failed=4)
    out = result.stdout.str()
    for name in ("test_sleeps_past_the_limit", "test_slow_only_in_its_fixture"):
        assert f"test_inner.py::{name} took" in out
    assert "test_inner.py::test_sets_up_a_slow_shared_fixture: its shared fixture 'slow_shared' took" in out
    assert "mark the tests that use it @pytest.mark.slow" in out
    assert "over the 0.5 s limit of a test not marked slow (ARMOR_SLOW_TEST_SECONDS): mark it @pytest.mark.slow" in out
    assert "its own assertion" in out and "test_failing_slowly_keeps_its_own_failure took" not in out
    assert "test_marked_slow_may_take_long took" not in out


@pytest.mark.timeout(120)
def test_the_limit_is_set_by_the_environment(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0", "-k", "past_the_limit or slow_shared_fixture")  # 0: no limit
    result.assert_outcomes(passed=2)
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
