"""Verifiers naming the row fields they want, and group and batch verifiers (armor_megatron.rewards.fields)."""

import pytest

from armor_megatron.rewards import VerifierSpecError, load_verifier, score_batch
from armor_megatron.rewards.fields import LEGACY, CallPlan, call_plan
from armor_megatron.rewards.registry import VerifierResultError, probe_verifier

ROWS = "tests.rewards.row_verifiers"


def _keywords(plan: CallPlan) -> dict:
    return dict(plan.keywords)


def test_a_verifier_naming_no_field_takes_response_and_ground_truth_positionally():
    assert call_plan(lambda text, answer: 1.0, "v") is LEGACY
    assert call_plan(lambda *args: 1.0, "v") is LEGACY
    assert LEGACY.arguments({"response": "r", "ground_truth": "g", "prompt": "p"}) == (("r", "g"), {})


def test_named_fields_are_given_by_name_and_unnamed_leading_ones_take_the_old_places():
    def verl(data_source, solution_str, ground_truth, extra_info=None): ...

    def old_name(response, answer=None): ...

    def row_aware(text, ground_truth, prompt, row, trajectory=None): ...

    plan = call_plan(verl, "v")
    assert plan.scope == "response" and plan.positional == ()
    assert _keywords(plan) == {
        "data_source": "data_source",
        "solution_str": "response",
        "ground_truth": "ground_truth",
        "extra_info": "extra_info",
    }
    assert _keywords(call_plan(old_name, "v")) == {"response": "response", "answer": "ground_truth"}
    assert _keywords(call_plan(row_aware, "v"))["text"] == "response"
    assert call_plan(lambda response: 1.0, "v").fields == {"response"}  # no ground truth needed (a format rule)


def test_plural_names_make_group_and_batch_verifiers():
    def group(responses, ground_truth, prompt, trajectories=None): ...

    def batch(data_sources, solution_strs, ground_truths, extra_infos): ...

    assert call_plan(group, "v").scope == "group"
    assert call_plan(lambda responses: [], "v").scope == "group"
    assert call_plan(batch, "v").scope == "batch"
    values = call_plan(group, "v").values(["a", "b"], ["7", "7"], [{"prompt": "p"}, {"prompt": "p"}])
    assert values == {"response": ["a", "b"], "ground_truth": "7", "prompt": "p", "trajectory": [None, None]}
    values = call_plan(batch, "v").values(["a", "b"], ["1", "2"], [{"data_source": "x"}, {}])
    assert values["ground_truth"] == ["1", "2"] and values["data_source"] == ["x", None]


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            lambda response, ground_truth, judge_url: 0,
            "parameter 'judge_url' is no field a verifier can be given (response, solution_str",
        ),
        (lambda response, solution_str: 0, "names 'response' and 'solution_str', which are the same field"),
        (
            lambda responses, trajectory: 0,
            "scores several responses (group) but takes 'trajectory'; name it 'trajectories'",
        ),
        (
            lambda responses, ground_truths, prompt: 0,
            "scores several responses (batch) but takes 'prompt'; name it 'prompts'",
        ),
        (lambda response, ground_truths: 0, "takes 'ground_truths' but scores one response"),
        (lambda ground_truth, prompt: 0, "takes no response"),
        (lambda text: 0, "must accept (response, ground_truth)"),
    ],
    ids=["unknown", "twins", "group_trajectory", "batch_singular", "plural_single", "no_response", "legacy_one"],
)
def test_a_parameter_no_field_supplies_is_refused_at_load_in_one_line(fn, message):
    with pytest.raises(VerifierSpecError) as err:
        call_plan(fn, "my:judge")
    assert message in str(err.value) and "\n" not in str(err.value), err.value
    assert str(err.value).startswith("verifier 'my:judge'")


def test_a_verl_compute_score_runs_unchanged_in_a_worker_with_the_rows_fields():
    verl = f"{ROWS}:compute_score"
    fields = {"data_source": "openai/gsm8k", "extra_info": {"split": "test"}}
    results = score_batch(["so #### 1,234", "#### 7", "no answer"], ["1234"] * 3, verl, fields=[fields] * 3)
    assert [r.score for r in results] == [1.0, 0.0, 0.0]
    train = {"data_source": "openai/gsm8k", "extra_info": {"split": "train"}}
    assert load_verifier(verl)("#### 1234", "1234", train).score == 1.5  # extra_info reached it
    with pytest.raises(ValueError, match=r"raised NotImplementedError: reward function is not implemented"):
        load_verifier(verl)("#### 1", "1", {"data_source": "other"})


def test_a_row_aware_verifier_gets_the_prompt_and_the_whole_row():
    row = {"question": "2+2?", "hint": "four", "answer": "4"}
    fields = {"prompt": [{"role": "user", "content": "2+2?"}], "row": row}
    results = score_batch(["four", "five"], ["4", "4"], f"{ROWS}:sees_the_row", fields=[fields] * 2)
    assert [(r.score, r.breakdown) for r in results] == [(1.0, {"prompt_chars": 4.0}), (0.0, {"prompt_chars": 4.0})]


def test_a_group_verifier_is_called_once_per_prompt_with_all_its_responses():
    responses = ["the answer is 12", "12", "13", "7 or 3", "3", "x"]
    results = score_batch(responses, ["12"] * 3 + ["3"] * 3, f"{ROWS}:ranks", groups=[0, 0, 0, 1, 1, 1])
    assert [r.score for r in results] == [0.5, 1.0, 0.0, 0.5, 1.0, 0.0]
    alone = score_batch(responses[:2], ["12"] * 2, f"{ROWS}:ranks")  # no groups: each response alone
    assert [r.score for r in alone] == [1.0, 1.0]


def test_a_batch_verifier_in_verls_form_scores_the_batch_in_one_call():
    fields = [{"data_source": "openai/gsm8k", "extra_info": None}] * 2
    results = score_batch(["#### 5", "#### 6"], ["5", "5"], f"{ROWS}:verl_batch", fields=fields)
    assert [r.score for r in results] == [1.0, 0.0]


def test_a_wrong_number_of_scores_is_one_line_naming_the_verifier():
    with pytest.raises(VerifierResultError) as err:
        score_batch(["a", "b", "c"], ["1"] * 3, f"{ROWS}:drops_one", labels=["row 4", "row 4", "row 5"])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"row 4 and 2 more: verifier '{ROWS}:drops_one' returned 2 scores for 3 responses"), line
    with pytest.raises(VerifierSpecError, match=r"returned 0 scores for 1 responses; a batch verifier returns one"):
        probe_verifier(f"{ROWS}:drops_one", "1")


def test_the_probe_calls_a_verifier_with_the_rows_real_fields():
    probe_verifier(f"{ROWS}:compute_score", "2", fields={"data_source": "openai/gsm8k"})
    with pytest.raises(VerifierSpecError, match="raised NotImplementedError on a response stating the ground truth"):
        probe_verifier(f"{ROWS}:compute_score", "2", fields={"data_source": "lighteval/MATH"})


def test_fields_that_do_not_pickle_are_one_line():
    with pytest.raises(ValueError, match=r"its arguments do not pickle .* row fields must be plain data"):
        load_verifier(f"{ROWS}:sees_the_row")("x", "1", {"prompt": "p", "row": {"hint": lambda: 0}})
