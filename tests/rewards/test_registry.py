import json

import pytest

from armor_megatron.data.prompts import PromptDataset
from armor_megatron.errors import UserInputError
from armor_megatron.rewards import (
    RewardResult,
    VerifierSpecError,
    compute_score,
    get_verifier,
    load_verifier,
    register_verifier,
    registered_verifiers,
    registry,
    scorable,
)

USER = "tests.rewards.user_verifiers"


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_GROUND_TRUTH_CHECKS", dict(registry._GROUND_TRUTH_CHECKS))


def test_builtin_verifiers_are_registered():
    assert {"math", "multiple_choice", "format", "think_format"} <= set(registered_verifiers())
    assert load_verifier("math") is get_verifier("math")


def test_user_verifier_number_becomes_reward_result():
    verify = load_verifier(f"{USER}:exact_match")
    assert verify(" 7 ", 7) == RewardResult(1.0, {}, None)
    assert compute_score("8", 7, verifier=f"{USER}:exact_match").score == 0.0


def test_user_verifier_dict_keeps_numeric_entries():
    result = load_verifier(f"{USER}:with_breakdown")("abcd", None)
    # score = scale * len("abcd"); the string "note" is not a criterion and is dropped
    assert result == RewardResult(4.0, {"length": 4.0}, "abc")


def test_user_verifier_reward_result_and_dotted_attribute():
    assert load_verifier(f"{USER}:full_result")("", None) == RewardResult(0.5, {"half": 1.0}, "x")
    assert load_verifier(f"{USER}:Judge.score")("", None).score == 1.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_pkg.rewards:judge", r"cannot import module 'no_such_pkg.rewards' \(ModuleNotFoundError"),
        (f"{USER}:missing", f"module '{USER}' has no attribute 'missing'"),
        (f"{USER}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
        (f"{USER}:takes_one", r"must accept \(response, ground_truth\) but its signature is \(text\)"),
        ("mod:", "not of the form 'package.module:function'"),
        (":fn", "not of the form"),
        ("a b:c", "not of the form"),
        ("mathh", "unknown verifier 'mathh'; did you mean 'math'?"),
        ("nonsense", r"unknown verifier 'nonsense' \(registered: format, knowledge, math"),
    ],
)
def test_bad_specs_give_one_line_errors(spec, match):
    with pytest.raises(VerifierSpecError, match=match) as info:
        load_verifier(spec)
    assert "\n" not in str(info.value)


def test_module_that_fails_while_importing(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import definitely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        VerifierSpecError, match="cannot import module 'broken_reward_mod'.*definitely_not_installed_pkg"
    ):
        load_verifier("broken_reward_mod:judge")


@pytest.mark.parametrize(
    "fn, error, match",
    [
        ("returns_list", TypeError, r"returned list \[1.0\]; expected RewardResult, a number, or a dict"),
        ("returns_nan", ValueError, "score must be finite"),
    ],
)
def test_bad_return_values(fn, error, match):
    with pytest.raises(error, match=match):
        load_verifier(f"{USER}:{fn}")("x", None)


def test_register_verifier(scratch_registry):
    @register_verifier("length_bonus")
    def length_bonus(response, ground_truth):
        return {"score": min(len(response), 10) / 10, "long": len(response) > 10}

    assert length_bonus("abc", None)["score"] == 0.3  # the decorator returns the function unchanged
    assert get_verifier("length_bonus")("abcde", None) == RewardResult(0.5, {"long": 0.0})
    assert compute_score("x" * 20, None, verifier="length_bonus").score == 1.0


def test_register_rejects_duplicates_bad_names_and_signatures(scratch_registry):
    with pytest.raises(VerifierSpecError, match="'math' is already registered"):
        register_verifier("math")(lambda r, g: 0.0)
    register_verifier("math", replace=True)(lambda r, g: 0.25)
    assert get_verifier("math")("", None).score == 0.25
    for name in ("", "a:b", " x"):
        with pytest.raises(VerifierSpecError, match="must be a non-empty string"):
            register_verifier(name)
    with pytest.raises(VerifierSpecError, match="must accept"):
        register_verifier("two_kw")(lambda *, a, b: 0.0)


def test_unregister_verifier(scratch_registry):
    register_verifier("scratch_one")(lambda r, g: 1.0)
    assert "scratch_one" in registered_verifiers()
    registry.unregister_verifier("scratch_one")
    assert "scratch_one" not in registered_verifiers()
    with pytest.raises(VerifierSpecError, match="unknown verifier 'scratch_one'"):
        get_verifier("scratch_one")
    with pytest.raises(VerifierSpecError, match="'scratch_one' is not registered, so it cannot be unregistered"):
        registry.unregister_verifier("scratch_one")
    register_verifier("scratch_one")(lambda r, g: 0.5)  # the name is free again
    assert get_verifier("scratch_one")("", None).score == 0.5


def test_compute_score_rejects_non_string_response():
    with pytest.raises(TypeError, match="response must be a str, got list"):
        compute_score(["x"], "1")


def test_reward_result_validation():
    assert RewardResult(True, {"a": 1}).score == 1.0
    with pytest.raises(TypeError, match="score must be a number, got str"):
        RewardResult("1")
    with pytest.raises(ValueError, match=r"breakdown\['a'\] must be finite"):
        RewardResult(1.0, {"a": float("inf")})


def test_a_ground_truth_no_verifier_can_score_is_refused_when_the_dataset_loads(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows += [{"prompt": "pick", "answer": "C", "type": "multiple_choice"}, {"prompt": "9+1=", "answer": None}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"train.jsonl: row 21: ground truth None cannot be scored by verifier 'math'"):
        scorable(PromptDataset(str(path)), "math")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    assert len(scorable(PromptDataset(str(path)), "math")) == 21


def test_a_rows_type_may_name_only_registered_or_listed_verifiers(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows.append({"prompt": "print(1)", "answer": {}, "type": "builtins:exec"})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserInputError, match=r"train.jsonl: row 20: verifier 'builtins:exec' is not allowed") as err:
        scorable(PromptDataset(str(path)), "math")
    assert "reward.verifiers" in str(err.value) and "\n" not in str(err.value)
    judge = "tests.rewards.user_verifiers:exact_match"
    rows[20] = {"prompt": "1", "answer": "1", "type": judge}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserInputError, match="row 20: verifier 'tests.rewards.user_verifiers:exact_match' is not"):
        scorable(PromptDataset(str(path)), "math")
    assert len(scorable(PromptDataset(str(path)), "math", [judge])) == 21  # listed in reward.verifiers
    assert len(scorable(PromptDataset(str(path)), judge)) == 21  # the config's reward.verifier
    rows[20]["type"] = 7
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserInputError, match="row 20: verifier 7 is a int, not a verifier name"):
        scorable(PromptDataset(str(path)), "math")
