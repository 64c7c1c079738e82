"""User verifiers (``module:function``) run in killable reward workers under ``reward.timeout_s``."""

import threading

import pytest

from armor_megatron.rewards import RewardResult, VerifierSpecError, compute_score, isolated, score_batch
from armor_megatron.rewards.registry import VerifierResultError, probe_verifier
from armor_megatron.rewards.spec import add_search_paths
from armor_megatron.rewards.user_calls import (
    VerifierFailed,
    VerifierTimeouts,
    configure_user_verifiers,
    user_verifier_timeout,
)

USER = "tests.rewards.user_verifiers"
HANGS = f"{USER}:hangs_on_hang"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def timeouts():
    """``set(timeout_s, in_a_row)`` for the test; the defaults come back after it."""
    before = user_verifier_timeout()
    yield lambda t, n: configure_user_verifiers(t, n)
    configure_user_verifiers(before, 8)


@pytest.mark.slow  # reward worker processes, killed and replaced
def test_a_call_that_hangs_scores_0_and_counts_as_a_timeout(timeouts):
    timeouts(0.5, 3)
    assert compute_score("hang", "1", HANGS) == RewardResult(0.0, {"timed_out": 1.0})
    assert compute_score("fine", "1", HANGS).score == 1.0  # its worker was replaced; the count starts afresh
    assert compute_score("hang", "1", HANGS).breakdown == {"timed_out": 1.0}
    assert compute_score("hang", "1", HANGS).breakdown == {"timed_out": 1.0}
    with pytest.raises(VerifierTimeouts) as err:  # the third in a row: it hangs, the step fails
        compute_score("hang", "1", HANGS)
    line = str(err.value)
    assert line.startswith(f"verifier '{HANGS}' did not return within reward.timeout_s=0.5s on 3 responses in a row")
    assert "reward.max_consecutive_timeouts=3" in line and "\n" not in line


@pytest.mark.slow  # reward worker processes, killed and replaced
def test_a_batch_stops_at_the_limit_without_scoring_the_rest(timeouts):
    timeouts(0.3, 2)
    with pytest.raises(VerifierTimeouts, match="on 2 responses in a row"):
        score_batch(["hang"] * 1000, ["1"] * 1000, verifier=HANGS, max_workers=2)  # all: 150 s


def test_what_a_user_verifier_raises_or_returns_is_named_in_one_line():
    with pytest.raises(VerifierFailed, match=rf"verifier '{USER}:raises' raised KeyError: 'no judge for this row'"):
        compute_score("x", "1", f"{USER}:raises")
    nan = f"{USER}:returns_nan"
    with pytest.raises(VerifierResultError) as err:
        score_batch(["a", "b"], ["1", "2"], verifier=nan, max_workers=1, labels=["row 17", "row 18"])
    assert str(err.value) == (
        f"row 17: verifier '{nan}' returned nan: RewardResult.score must be finite, got nan, "
        "for the response 'a' (ground truth '1')"
    )


@pytest.mark.slow  # reward worker processes, killed and replaced
def test_a_reply_over_the_output_cap_kills_the_worker_and_scores_0(monkeypatch, timeouts):
    timeouts(30, 8)
    monkeypatch.setattr(isolated, "MAX_REPLY_BYTES", 1000)
    assert compute_score("x", "1", f"{USER}:long_extracted").breakdown == {"worker_died": 1.0}
    monkeypatch.setattr(isolated, "MAX_REPLY_BYTES", 1 << 20)
    assert compute_score("x", "1", f"{USER}:long_extracted").extracted == "x" * 5000


def test_interrupt_calls_stops_a_hanging_call_at_once_and_refuses_new_ones(timeouts):
    timeouts(3600, 8)  # only the interruption can end this call
    outcome = []

    def score():
        try:
            compute_score("hang", "1", HANGS)
        except isolated.CallsInterrupted as err:
            outcome.append(err)

    thread = threading.Thread(target=score)
    thread.start()
    try:
        thread.join(1.0)  # it is waiting for its worker
        assert thread.is_alive()
        isolated.interrupt_calls()
        thread.join(30)
        assert not thread.is_alive() and len(outcome) == 1
        with pytest.raises(isolated.CallsInterrupted):
            compute_score("fine", "1", HANGS)
    finally:
        isolated.allow_calls()
    assert compute_score("fine", "1", HANGS).score == 1.0


def test_the_start_up_probe_times_out_on_a_hanging_verifier(timeouts):
    timeouts(0.5, 8)
    with pytest.raises(VerifierSpecError) as err:
        probe_verifier(f"{USER}:hangs_always", "1")
    assert str(err.value) == (
        f"verifier '{USER}:hangs_always' did not return within reward.timeout_s=0.5s on a response stating the "
        "ground truth '1'"
    )


def test_a_module_in_reward_python_path_is_found_by_the_workers(tmp_path):
    (tmp_path / "judge_in_python_path.py").write_text("def judge(response, ground_truth):\n    return 0.25\n")
    add_search_paths([str(tmp_path)])
    assert compute_score("x", "1", "judge_in_python_path:judge").score == 0.25
