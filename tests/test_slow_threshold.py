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
    time.sleep(0.6)


def test_quick():
    pass


def test_sleeps_past_the_limit():
    time.sleep(0.6)


def test_slow_only_in_its_fixture(slow_setup):
    pass


@pytest.mark.slow
def test_marked_slow_may_take_long():
    time.sleep(0.6)


def test_failing_slowly_keeps_its_own_failure():
    time.sleep(0.6)
    assert False, "its own assertion"
"""


def _run(pytester, monkeypatch, limit):
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=SUITE)
    monkeypatch.setenv("ARMOR_SLOW_TEST_SECONDS", limit)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")


@pytest.mark.timeout(120)
def test_a_test_over_the_limit_fails_unless_marked_slow(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0.3")
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    for name in ("test_sleeps_past_the_limit", "test_slow_only_in_its_fixture"):
        assert f"test_inner.py::{name} took" in out
    assert "over the 0.3 s limit of a test not marked slow (ARMOR_SLOW_TEST_SECONDS): mark it @pytest.mark.slow" in out
    assert "its own assertion" in out and "test_failing_slowly_keeps_its_own_failure took" not in out
    assert "test_marked_slow_may_take_long took" not in out


@pytest.mark.timeout(120)
def test_the_limit_is_set_by_the_environment(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0")  # 0: no limit
    result.assert_outcomes(passed=4, failed=1)
    result = _run(pytester, monkeypatch, "soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ARMOR_SLOW_TEST_SECONDS='soon' is not a number of seconds*"])
