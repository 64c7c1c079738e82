"""Multi-turn rollouts: token ids end to end, the loss mask, the limits, on the local engine and over
HTTP against the SGLang test double (which runs the same local model)."""

import dataclasses
import time

import pytest
import torch

from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.multiturn import (
    EnvironmentSettings,
    EnvironmentSpecError,
    EnvironmentStepError,
    MultiTurnRollout,
    truncation_metrics,
)
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode

SAMPLING = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True)


class Lookup:
    """Answers each model turn with ``" =<row answer><turn>? "`` until it has answered ``rounds`` turns."""

    rounds = 2

    def __init__(self, row):
        self.answer, self.turns = row["answer"], 0

    def step(self, response):
        self.turns += 1
        return None if self.turns > self.rounds else f" ={self.answer}{self.turns}? "


class Endless(Lookup):
    rounds = 10**9


class Slow(Lookup):
    def step(self, response):
        if self.answer == "slow":
            time.sleep(30)
        return super().step(response)


class Broken(Lookup):
    def step(self, response):
        raise KeyError("no tool named 'calc'")


class NotText(Lookup):
    def step(self, response):
        return 42


class NeedsExpression(Lookup):
    def __init__(self, row):
        super().__init__(row)
        self.expression = row["expression"]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    path, _, _ = tiny_ckpt
    return LocalEngine.from_pretrained(path, weight_version="v0", seed=3)


def _rollout(tok, env=Lookup, **limits):
    settings = EnvironmentSettings(
        spec="tests:Lookup", **{"max_turns": 4, "tool_timeout_s": 10.0, "max_turn_tokens": 5, **limits}
    )
    return MultiTurnRollout(settings, lambda text: encode(tok, text), environment=env)


def _teacher_forced(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _check_trajectory(sample, prompt, tok, model):
    """Model turns and observations alternate as the trajectory says; ids, mask and log-probs line up."""
    ids, mask = list(sample.token_ids), list(sample.loss_mask)
    at = 0
    for turn in sample.trajectory:
        n_model = next((k for k in range(at, len(mask)) if mask[k] == 0), len(mask)) - at
        assert n_model >= 1 and all(mask[at : at + n_model])
        at += n_model
        if turn["observation"] is not None:
            obs = encode(tok, turn["observation"])  # tokenised once, appended as is
            assert ids[at : at + len(obs)] == obs and not any(mask[at : at + len(obs)])
            assert all(lp == 0.0 for lp in sample.logprobs[at : at + len(obs)])
            at += len(obs)
    assert at == len(ids)
    # the engine's log-probs of the model's tokens are the trainer's teacher-forced ones, token for token
    full = list(prompt) + ids
    expected = _teacher_forced(model, full)[len(prompt) - 1 :]
    model_at = torch.tensor(mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(sample.logprobs)[model_at], expected[model_at], atol=1e-5, rtol=0)


def test_a_multi_turn_sample_keeps_token_ids_mask_and_logprobs_aligned(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompts = [encode(tok, "what is 3+4?"), encode(tok, "ab")]
    rows = [{"answer": "7", "index": 0}, {"answer": "x", "index": 1}]
    groups = _rollout(tok).generate(engine.generate, prompts, rows, 2, dataclasses.replace(SAMPLING, max_new_tokens=20))
    assert [len(g) for g in groups] == [2, 2]
    for prompt, group in zip(prompts, groups):
        for s in group:
            answer = rows[s.prompt_index]["answer"]
            assert [t["observation"] for t in s.trajectory] == [f" ={answer}1? ", f" ={answer}2? ", None]
            assert s.finish_reason == "length" and s.trajectory[-1]["truncated"] is None
            assert s.model_tokens == 15 and s.env_tokens == 2 * len(encode(tok, " =71? "))
            assert s.weight_version == "v0"
            _check_trajectory(s, prompt, tok, engine.model)


def test_the_model_token_budget_counts_model_tokens_over_all_turns(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "1+1=")
    # 12 model tokens: turns of 5 and 5, then 2 of the third turn's 5 (cut to the budget)
    [[s]] = _rollout(tok, Endless).generate(
        engine.generate, [prompt], [{"answer": "2"}], 1, dataclasses.replace(SAMPLING, max_new_tokens=12)
    )
    assert s.model_tokens == 12 and s.finish_reason == "length" and s.trajectory[-1]["truncated"] is None
    assert [t["observation"] is not None for t in s.trajectory] == [True, True, False]
    _check_trajectory(s, prompt, tok, engine.model)


def test_each_limit_ends_a_trajectory_with_its_flag(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "1+1=")
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=50)
    [[turns]] = _rollout(tok, Endless, max_turns=3).generate(engine.generate, [prompt], [{"answer": "2"}], 1, sampling)
    assert len(turns.trajectory) == 3 and turns.trajectory[-1] == {
        "response": turns.trajectory[-1]["response"],
        "observation": None,  # the observation the environment still had is not appended
        "truncated": "max_turns",
    }
    assert turns.finish_reason == "length" and turns.model_tokens == 15
    obs = len(encode(tok, " =21? "))
    total = len(prompt) + 5 + obs + 5 + obs - 1  # the second observation leaves no room for a model token
    [[tokens]] = _rollout(tok, Endless, max_total_tokens=total).generate(
        engine.generate, [prompt], [{"answer": "2"}], 1, sampling
    )
    assert tokens.trajectory[-1]["truncated"] == "max_total_tokens" and len(tokens.trajectory) == 2
    assert len(prompt) + tokens.num_tokens <= total and tokens.finish_reason == "length"
    # a model turn is cut to what the total leaves
    [[cut]] = _rollout(tok, Endless, max_total_tokens=len(prompt) + 5 + obs + 3).generate(
        engine.generate, [prompt], [{"answer": "2"}], 1, sampling
    )
    assert cut.num_tokens == 5 + obs + 3 and cut.model_tokens == 8 and cut.finish_reason == "length"
    # a prompt that fills max_total_tokens by itself gets an empty response
    [[empty]] = _rollout(tok, max_total_tokens=len(prompt)).generate(
        engine.generate, [prompt], [{"answer": "2"}], 1, sampling
    )
    assert empty.token_ids == () and empty.trajectory == () and empty.finish_reason == "length"
    # a slow tool: its trajectory ends flagged, the others go on
    begin = time.monotonic()
    slow, fast = _rollout(tok, Slow, tool_timeout_s=0.5).generate(
        engine.generate, [prompt, prompt], [{"answer": "slow"}, {"answer": "2"}], 1, sampling
    )
    assert time.monotonic() - begin < 20
    assert slow[0].trajectory[-1]["truncated"] == "tool_timeout" and slow[0].finish_reason == "length"
    # the environment ends the episode after a turn cut at max_turn_tokens: the response's finish is that turn's
    assert len(fast[0].trajectory) == 3 and fast[0].finish_reason == "length"
    metrics = truncation_metrics([turns, tokens, cut, slow[0], fast[0]])
    assert metrics["rollout/env_truncated/max_turns"] == 0.2 and metrics["rollout/env_truncated/tool_timeout"] == 0.2
    assert metrics["rollout/env_truncated/max_total_tokens"] == 0.4
    assert metrics["rollout/turns"] == (3 + 2 + 2 + 1 + 3) / 5


def test_environment_errors_name_the_row_and_keep_the_cause(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    with pytest.raises(EnvironmentStepError, match=r"raised on row 7, turn 1: KeyError") as info:
        _rollout(tok, Broken).generate(engine.generate, [encode(tok, "1")], [{"answer": "1", "index": 7}], 1, SAMPLING)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(EnvironmentStepError, match="raised KeyError: 'expression' building the environment of row 7 "):
        _rollout(tok, NeedsExpression).generate(engine.generate, [[1]], [{"answer": "1", "index": 7}], 1, SAMPLING)
    with pytest.raises(EnvironmentStepError, match="returned a int on row 7, turn 1"):
        _rollout(tok, NotText).generate(engine.generate, [encode(tok, "1")], [{"answer": "1", "index": 7}], 1, SAMPLING)
    settings = EnvironmentSettings(spec="tests.rollout.test_multiturn:Missing")
    with pytest.raises(EnvironmentSpecError, match="^rollout.environment.spec 'tests.rollout.test_multiturn:Missing'"):
        MultiTurnRollout(settings, lambda text: encode(tok, text))
    rollout = MultiTurnRollout(
        EnvironmentSettings(spec="tests.rollout.test_multiturn:Lookup"), lambda t: encode(tok, t)
    )
    assert rollout.environment is Lookup


def test_over_http_each_turn_is_one_generate_request_with_the_ids_so_far(tiny_ckpt):
    path, _, tok = tiny_ckpt
    local = LocalEngine.from_pretrained(path, weight_version="default")
    prompts = [encode(tok, "what is 3+4?"), encode(tok, "ab")]
    rows = [{"answer": "7"}, {"answer": "x"}]
    with SGLangTestServer(local, model_path=path) as server:
        engine = SGLangEngine([server.url], vocab_size=len(tok))
        before = server.requests.get("/generate", 0)
        groups = _rollout(tok).generate(
            engine.generate, prompts, rows, 2, dataclasses.replace(SAMPLING, max_new_tokens=20)
        )
        # three turns; per turn one request per live trajectory (n=1 each, input_ids)
        assert server.requests["/generate"] - before == 3 * 4
    for prompt, group in zip(prompts, groups):
        for s in group:
            assert len(s.trajectory) == 3 and s.model_tokens == 15
            _check_trajectory(s, prompt, tok, local.model)
