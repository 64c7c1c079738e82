import threading
import time

import pytest

from armor_megatron.rewards import compute_score, make_math_verifier, score_batch
from armor_megatron.rewards.math_answer import gold_answers

# (response, ground truth, expected score). Equivalence is math-verify's; the extraction
# (last \boxed / \fbox, balanced braces, DAPO "Answer:" fallback) is ours.
ACCEPTED = [
    (r"so \boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{1/2}", r"\frac12"),
    (r"\boxed{\dfrac{1}{2}}", "1/2"),
    (r"\boxed{\tfrac{1}{2}}", "0.5"),
    (r"The answer is \boxed{ 204 }.", "204"),
    (r"\boxed{204}", 204),  # numeric ground truth
    (r"\boxed{0.25}", 0.25),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{50\%}", "0.5"),  # a percentage equals its fraction...
    (r"\boxed{50\%}", "50"),  # ...and math-verify also accepts it for a gold written without %
    (r"\boxed{\{1, 2\}}", r"\{2,1\}"),  # sets in any order
    (r"\boxed{(1,2]}", r"\left(1, 2\right]"),  # intervals
    (r"\boxed{x=3}", "3"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\frac{\frac{1}{2}}{2}}", "1/4"),  # nested braces
    (r"\fbox{7}", "7"),
    (r"First \boxed{3}; no wait, \boxed{4}", "4"),  # the last box counts
    (r"\boxed{10^{3}}", "1000"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{5.0}", "5"),
    (r"\boxed{-\frac{3}{4}}", "-0.75"),
    (r"\boxed{\infty}", r"\infty"),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}"),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}"),
    (r"$\boxed{2}$", "$2$"),  # $-wrapped ground truth
    (r"\boxed {7}", "7"),
    (r"\boxed 7", "7"),  # brace-less form
    ("The total is 42.\nAnswer: 42", "42"),  # DAPO answer line when there is no box
    ("Answer: $\\frac{3}{5}$", "0.6"),
    (r"\boxed{12}", r"Adding up, the total is \boxed{12}."),  # reference solution as ground truth
    (r"\boxed{6}", ["5", "6"]),  # any of several accepted answers
    (r"\boxed{(1, \infty)}", r"(1,\infty)"),
    # AMC answers name the option and its value; MATH's golds are the option (\text{(D)})
    (r"$\boxed{\textbf{(D)}\ 24}$", "D"),
    (r"$\boxed{\textbf{(D)}\ 24}$", "24"),
    (r"$\boxed{\textbf{(D)}\ 24}$", r"\text{(D)}"),
    (r"\boxed{\text{(D) }24}", r"\textbf{(D) }24"),
    (r"\boxed{D}", r"\text{(D)}"),
    # E-notation (Minerva golds, Python floats): math-verify alone reads e as Euler's number
    (r"\boxed{4.5 \times 10^{33}}", "4.5e33"),
    (r"\boxed{7.2\times10^{-27}}", "7.2e-27"),
    (r"\boxed{6.02e23}", r"6.02 \times 10^{23}"),
    (r"\boxed{0.0000001}", 1e-07),  # str(1e-07) == "1e-07"
    (r"\boxed{10^{21}}", 1e21),  # str(1e21) == "1e+21"
    # thousands separated by a LaTeX space
    (r"\boxed{10\,000}", "10000"),
    (r"\boxed{\$2\,500}", "2500"),
    (r"\boxed{033}", "33"),  # AIME's three digits
    # reasoning models: the answer after </think>
    (r"<think>maybe \boxed{3}</think>So the answer is \boxed{4}.", "4"),
    (r"the prompt opened the reasoning... </think> \boxed{4}", "4"),
    # several boxes forming the final answer: their union, as a set
    (r"so \boxed{(2, 2)} \quad\text{and}\quad \boxed{(6, 2)}", "(2, 2), (6, 2)"),
    (r"so \boxed{(6, 2)} \quad\text{and}\quad \boxed{(2, 2)}", "(2, 2), (6, 2)"),  # order-free
    (r"\boxed{1},\boxed{2},\boxed{3}", r"\{1,2,3\}"),
    (r"\boxed{3},\boxed{1},\boxed{2}", r"\{1,2,3\}"),
    (r"$x = \boxed{-2}$ and $\boxed{1}$", "-2, 1"),
    (r"x = \boxed{1} \text{ or } x = \boxed{-2}", "-2, 1"),
    (r"\boxed{x = 6}, \boxed{6}", "6"),  # the same answer restated
    (r"\boxed{\frac{1}{2}} \quad \boxed{0.5}", "1/2"),
    (r"\boxed{1}, wait, \boxed{2}", "2"),  # the last box, once the response moved on
    (r"$\boxed{-2,1}$.", r"\(\boxed{1}\) and \(\boxed{-2}\)."),  # a reference solution with two boxes
    # the last stated answer wins over an earlier (intermediate) box
    ("First \\boxed{200}.\n\nFinal Answer: The final answer is $10,455$. I hope it is correct.", "10455"),
    ("\\boxed{3}\n\nAnswer: The answer is 3.", "3"),
    ("\\boxed{3}\n\nAnswer: see above", "3"),  # words alone: the box stands
    # escaped dollars and \! thousands in final-answer statements
    ("The final answer is $\\$32,\\!348$.", "32,\\!348"),
    ("The final answer is $\\$32,\\!348$.", "32348"),
    ("Answer: 11,\\! 111,\\! 111,\\! 100", "11,\\!111,\\!111,\\!100"),
    ("Answer: 11,\\! 111,\\! 111,\\! 100", "11111111100"),
    # option letters in any wrapper, with or without parentheses
    (r"\boxed{\text{(C)}}", r"\text{C}"),
    (r"\boxed{(C)}", r"\text{C}"),
    (r"\boxed{C}", r"\text{C}"),
    (r"\boxed{\text{(C)}}", r"\textbf{C}"),
    (r"\boxed{(C)}", r"\textbf{C}"),
    (r"\boxed{\text{(C)}}", r"\mathrm{C}"),
    (r"\boxed{(C)}", r"\mathrm{C}"),
    ("Answer: (C)", r"\mathrm{C}"),
    (r"\boxed{\mathbf{C}}", r"\text{(C)}"),
    (r"\boxed{\textbf{(C)}\ 24}", r"\mathrm{C}"),
]
REJECTED = [
    (r"\boxed{2}", "3"),
    (r"\boxed{-3}", "3"),
    (r"\boxed{0.333}", r"\frac{1}{3}"),  # floats are compared to 6 decimals
    (r"\boxed{\pi}", "3.14159"),
    ("No box here, it is 42", "42"),  # missing answer
    (r"\boxed{}", "0"),  # empty box
    (r"\boxed{42} and then, cut off: \boxed{4", "42"),  # unterminated last box: no answer
    (r"\boxed{3} then \boxed{4}", "3"),  # only the last box counts
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}"),
    (r"\boxed{[1,2]}", "(1,2]"),
    (r"\boxed{x=4}", "3"),
    (r"\boxed{12}", ["5", "6"]),
    (r"\boxed{\frac{1}{3}}", "0.3"),
    (r"$\boxed{\textbf{(D)}\ 24}$", "C"),
    (r"$\boxed{\textbf{(D)}\ 24}$", "25"),
    (r"\boxed{0.0000001}", "0.0000002"),  # not equal by rounding to 6 decimals
    (r"\boxed{1000001}", "1000000"),  # integers exactly
    (r"\boxed{1\,000}", "0"),  # math-verify alone reads 1\,000 as 1·000
    (r"\boxed{(A)\cup(B)}", "A"),  # a set expression, not an option
    # cut off while thinking: what it boxed on its way is no final answer
    (r"<think>Let me guess \boxed{72} but wait, I need to recompute 48+24 = ", "72"),
    # several boxes: twins of the accepted ones
    (r"so \boxed{(2, 2)} \quad\text{and}\quad \boxed{(6, 3)}", "(2, 2), (6, 2)"),  # one pair wrong
    (r"\boxed{(2, 2)}", "(2, 2), (6, 2)"),  # one pair missing
    (r"\boxed{(2, 2)} \quad\text{and}\quad \boxed{(6, 2)}", "(6, 2)"),  # one pair too many
    (r"\boxed{(2, 2)}, wait, \boxed{(6, 2)}", "(2, 2), (6, 2)"),  # the first was discarded
    (r"\boxed{1},\boxed{2}", r"\{1,2,3\}"),
    (r"\boxed{1},\boxed{2},\boxed{3},\boxed{4}", r"\{1,2,3\}"),
    (r"\boxed{1},\boxed{2},\boxed{3}", "3"),  # only the last box matches: not the answer given
    (r"$x = \boxed{2}$ and $\boxed{1}$", "-2, 1"),
    (r"$x = \boxed{-2}$ and $\boxed{1}$", "1"),
    (r"$x = \boxed{-2}$ and $\boxed{1}$", "-2"),
    (r"$x = \boxed{-2}$, so $\boxed{1}$", "-2, 1"),  # "so": the segment is the last box
    (r"\boxed{1}, wait, \boxed{2}", "1"),  # an alternative the response discarded
    (r"\boxed{1}, wait, \boxed{2}", "1, 2"),
    (r"\boxed{2} or \boxed{3}", "3"),  # a hedge scores nothing
    (r"$\boxed{-2}$.", r"\(\boxed{1}\) and \(\boxed{-2}\)."),
    (r"\boxed{12}, \boxed{345}", "12345"),  # a union is a set, never one number
    (r"\boxed{1}, \boxed{000}", "1000"),
    (r"\boxed{1}, \boxed{5}", "1.5"),
    # the last stated answer wins: the earlier box no longer counts
    ("First \\boxed{200}.\n\nFinal Answer: The final answer is $10,455$. I hope it is correct.", "200"),
    ("First \\boxed{200}.\n\nFinal Answer: The final answer is $10,456$. I hope it is correct.", "10455"),
    ("\\boxed{3}\n\nAnswer: 4", "3"),
    # escaped dollars and thousands: twins
    ("The final answer is $\\$32,\\!348$.", "32,\\!349"),
    ("The final answer is $\\$32$, \\!348. Let me check", "32348"),
    ("Answer: 11,\\! 111,\\! 111,\\! 101", "11111111100"),
    ("Answer: 11! 111", "11111"),
    # option letters: another letter, or two options, never match
    (r"\boxed{\text{(D)}}", r"\text{C}"),
    (r"\boxed{(D)}", r"\textbf{C}"),
    (r"\boxed{D}", r"\mathrm{C}"),
    (r"\boxed{\text{(C)}, \text{(D)}}", "C"),
    (r"\boxed{\text{(C)} \text{ or } \text{(D)}}", r"\text{C}"),
    (r"\boxed{\textbf{(C)}\ 24 \text{ or } \textbf{(D)}\ 30}", "C"),
    (r"\boxed{\text{(C)}} \quad \boxed{\text{(D)}}", r"\text{(C)}"),
]


@pytest.fixture(scope="module")
def verify():
    return make_math_verifier(timeout_s=10.0)


@pytest.mark.parametrize("response, gold", ACCEPTED)
def test_accepts_equivalent_answers(verify, response, gold):
    result = verify(response, gold)
    assert result.score == 1.0, result
    assert result.breakdown == {"answer_found": 1.0, "correct": 1.0, "timed_out": 0.0}


@pytest.mark.parametrize("response, gold", REJECTED)
def test_rejects_wrong_or_missing_answers(verify, response, gold):
    result = verify(response, gold)
    assert result.score == 0.0, result
    assert result.breakdown["correct"] == 0.0 and result.breakdown["timed_out"] == 0.0


def test_breakdown_and_extracted_answer(verify):
    assert verify(r"so \boxed{ \frac{1}{2} }.", "0.5").extracted == r"\frac{1}{2}"
    assert verify(r"$x = \boxed{-2}$ and $\boxed{1}$", "-2, 1").extracted == "-2, 1"
    missing = verify("I do not know", "1")
    assert missing.extracted is None
    assert missing.breakdown == {"answer_found": 0.0, "correct": 0.0, "timed_out": 0.0}
    wrong = verify(r"\boxed{2}", "3")
    assert wrong.breakdown == {"answer_found": 1.0, "correct": 0.0, "timed_out": 0.0}


def test_answer_line_fallback_can_be_disabled():
    strict = make_math_verifier(answer_line_fallback=False)
    assert strict("Answer: 42", "42").score == 0.0
    assert strict(r"Answer: \boxed{42}", "42").score == 1.0


def test_compute_score_defaults_to_math():
    assert compute_score(r"\boxed{\dfrac{1}{2}}", "0.5").score == 1.0
    assert compute_score(r"\boxed{1}", "0.5").score == 0.0


PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # math-verify tries to evaluate the power tower


def _timed(verify, response, gold):
    start = time.monotonic()
    result = verify(response, gold)
    return result, time.monotonic() - start


@pytest.mark.slow  # a worker process killed at its budget and replaced
@pytest.mark.timeout(120)
def test_pathological_answer_times_out_with_score_zero():
    verify = make_math_verifier(timeout_s=2.0)
    verify(r"\boxed{2}", "3")  # warm a worker: start-up is not part of the timeout
    result, elapsed = _timed(verify, PATHOLOGICAL, "5")
    assert result.score == 0.0
    assert result.breakdown == {"answer_found": 1.0, "correct": 0.0, "timed_out": 1.0}
    # the comparison ran for its whole budget and was cut there: without the timeout the power tower
    # never finishes, so a generous upper bound (any load) still tells the two apart
    assert 2.0 <= elapsed < 60.0
    # the killed worker is replaced: the next comparison works
    assert verify(r"\boxed{\frac{1}{2}}", "0.5").score == 1.0


@pytest.mark.slow  # 16 s on a loaded 2-core machine (worker start-up, the 2 s budget, a replacement)
@pytest.mark.timeout(120)
def test_timeout_works_off_the_main_thread():
    # math-verify's own signal.alarm timeout raises ValueError in a thread; ours must not.
    verify = make_math_verifier(timeout_s=2.0)
    verify(r"\boxed{2}", "3")
    results = {}

    def score():
        results["pathological"] = _timed(verify, PATHOLOGICAL, "5")
        results["normal"] = verify(r"\boxed{0.5}", "1/2")

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(60)
    result, elapsed = results["pathological"]
    assert result.breakdown["timed_out"] == 1.0 and 2.0 <= elapsed < 60.0
    assert results["normal"].score == 1.0


@pytest.mark.slow  # a worker process killed and replaced
def test_worker_death_scores_zero_but_worker_errors_raise(monkeypatch):
    from armor_megatron.rewards import math_answer
    from armor_megatron.rewards.isolated import IsolatedCallError

    verify = make_math_verifier(timeout_s=30.0)
    monkeypatch.setattr(math_answer, "_EQUIVALENT", "tests.rewards.worker_targets:die_comparing")
    result = verify(r"\boxed{2}", "3")
    assert result.score == 0.0 and result.breakdown == {"answer_found": 1.0, "correct": 0.0, "timed_out": 0.0}
    monkeypatch.setattr(math_answer, "_EQUIVALENT", "tests.rewards.worker_targets:raise_comparing")
    with pytest.raises(IsolatedCallError, match="ModuleNotFoundError: No module named 'math_verify'"):
        verify(r"\boxed{2}", "3")


def test_gold_answers_normalisation():
    assert gold_answers(r"$\frac{1}{2}$") == [r"\frac{1}{2}"]
    assert gold_answers(r"... hence \boxed{12}.") == ["12"]
    assert gold_answers(r"so $n = \boxed{1}$ and $\boxed{-2}$.") == ["1, -2"]  # its final box segment
    assert gold_answers(r"\boxed{1}, so \boxed{2}") == ["2"]
    assert gold_answers([3, "4"]) == ["3", "4"]


@pytest.mark.parametrize(
    "gold, error, match",
    [
        ("", ValueError, "is empty"),
        ([], ValueError, "empty list"),
        (None, TypeError, "string or number, got NoneType"),
        (True, TypeError, "string or number, got bool"),
    ],
)
def test_bad_ground_truth_is_one_clear_error(verify, gold, error, match):
    with pytest.raises(error, match=match):
        verify(r"\boxed{1}", gold)


@pytest.mark.parametrize(
    "verifier, gold, match",
    [
        ("math", None, "'math': math ground truth must be a string or number, got NoneType"),
        ("math", {"ground_truth": "5"}, "got dict"),  # a verl-style reward_model column
        ("math", "  ", "is empty"),
        ("multiple_choice", "Z", "not one of the option letters A-J"),
    ],
)
def test_registered_verifiers_check_ground_truths_before_any_scoring(verifier, gold, match):
    from armor_megatron.rewards import check_ground_truth

    with pytest.raises(ValueError, match=match):
        check_ground_truth(verifier, gold)
    check_ground_truth(verifier, "B")  # scorable by both
    check_ground_truth("tests.rewards.user_verifiers:anything", None)  # user verifiers declare no check


def test_bad_timeout_rejected():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        make_math_verifier(timeout_s=0)


# Through the public batch API, as the trainer scores: formats and truncation.
FINAL_FORMS = [
    ("Reasoning...\nThe final answer is $204$.", "204", 1.0),
    ("Final Answer: The final answer is $\\frac{14}{3}$. I hope it is correct.", "14/3", 1.0),
    (r"\boxed{204.}", "204", 1.0),
    ("Answer: 204.", "204", 1.0),
    ("Answer: 204\nWait, let me redo this... so \\boxed{205", "204", 0.0),  # truncated in the last box
    ("So the candidate answer: \\frac{14}{3}. Hmm, but wait", "14/3", 0.0),  # truncated mid-reasoning
    ("Answer: 204\nWait, that is not right, let me", "204", 0.0),
]


def test_final_forms_and_truncated_responses_through_score_batch():
    responses, golds, expected = zip(*FINAL_FORMS)
    results = score_batch(list(responses), list(golds), verifier="math", max_workers=2)
    assert [r.score for r in results] == list(expected)


@pytest.mark.timeout(300)
def test_adversarial_responses_score_within_the_timeout_end_to_end():
    verify = make_math_verifier(timeout_s=5.0)
    verify(r"\boxed{2}", "3")  # warm a worker
    for response in ("\\boxed{" * 14286, "answer" + " " * 100_000, "Answer:" + " " * 100_000 + "x" * 10):
        result, elapsed = _timed(verify, response, "204")
        assert result.score == 0.0
        # catastrophic backtracking in answer extraction (outside the worker's timeout) would take
        # minutes to hours on these inputs; linear extraction takes milliseconds
        assert elapsed < 60.0, (response[:20], elapsed)


@pytest.mark.slow  # a worker process killed at its budget and replaced
@pytest.mark.timeout(120)
def test_acceptable_answers_share_one_timeout(monkeypatch):
    from armor_megatron.rewards import math_answer

    calls = []

    def recording(target, *args, timeout_s):
        calls.append((args, timeout_s))
        return run_isolated(target, *args, timeout_s=timeout_s)

    run_isolated = math_answer.run_isolated
    monkeypatch.setattr(math_answer, "run_isolated", recording)
    verify = make_math_verifier(timeout_s=2.0)
    result = verify(PATHOLOGICAL, ["5", "6", "7", "8"])
    assert result.breakdown["timed_out"] == 1.0
    # one isolated comparison against all four answers under one 2 s budget, not 2 s per answer
    assert len(calls) == 1
    (answer, golds), budget = calls[0]
    assert golds == ["5", "6", "7", "8"] and 0 < budget <= 2.0
