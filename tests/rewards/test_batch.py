import pytest

from armor_megatron.rewards import compute_score, score_batch

pytestmark = pytest.mark.timeout(120)


def test_score_batch_matches_compute_score_in_order():
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", "no answer", r"\boxed{0.25}", r"\boxed{x^2}"] * 3
    golds = ["0.5", "4", "1", "1/4", "x*x"] * 3
    batch = score_batch(responses, golds, max_workers=4)
    assert [r.score for r in batch] == [1.0, 0.0, 0.0, 1.0, 1.0] * 3
    assert batch == [compute_score(r, g) for r, g in zip(responses, golds)]


def test_score_batch_other_verifiers_and_serial_path():
    results = score_batch(["Answer: B", "Answer: C"], ["B", 2], verifier="multiple_choice", max_workers=1)
    assert [r.score for r in results] == [1.0, 1.0]
    assert score_batch([], [], verifier="format") == []


def test_verifier_errors_propagate_from_threads():
    with pytest.raises(ValueError, match="not one of the option letters"):
        score_batch(["Answer: B", "Answer: C"], ["B", "Z"], verifier="multiple_choice", max_workers=2)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((["a"], ["1", "2"]), ValueError, "got 2 ground truths for 1 responses"),
        (([None], ["1"]), TypeError, "response must be a str, got NoneType"),
    ],
)
def test_bad_batches(args, error, match):
    with pytest.raises(error, match=match):
        score_batch(*args)


def test_bad_worker_count():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        score_batch(["a"], ["1"], max_workers=0)
