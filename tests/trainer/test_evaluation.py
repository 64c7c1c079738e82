"""Evaluation through the real local engine and the real verifier registry."""

import json

import pytest

from armor_megatron.data.prompts import PromptDataset, encode_prompt
from armor_megatron.rewards import RewardResult
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, tiny_config, tiny_weights
from armor_megatron.trainer.evaluation import EvalSet, evaluate, format_table
from tests.registered_verifiers import registered


def _exact(response, ground_truth):
    return RewardResult(float(response == ground_truth), {})


def _always(response, ground_truth):
    return RewardResult(1.0, {})


@pytest.fixture(scope="module", autouse=True)
def verifiers():
    with registered(test_exact_text=_exact, test_always=_always):
        yield


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    return LocalEngine(cfg, tiny_weights(cfg, seed=0, sharpen=4.0), tokenizer=tok), tok


def test_greedy_eval_scores_exactly_the_rows_whose_answer_is_the_models_output(tmp_path, engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    encode = lambda p: encode_prompt(tok, p, apply_chat_template=False)  # noqa: E731
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompts = ["1+1=", "2+2=", "3+3=", "4+4="]
    outputs = [g[0].text for g in engine.generate([encode(p) for p in prompts], n=1, sampling=greedy)]
    # rows 0 and 2 get the model's own greedy output as their answer, rows 1 and 3 a string it never writes
    rows = [
        {"prompt": p, "answer": out if i % 2 == 0 else "<never>"} for i, (p, out) in enumerate(zip(prompts, outputs))
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [EvalSet("toy", PromptDataset(str(tmp_path / "d.jsonl")), k=3)]
    result = evaluate(engine, encode, sets, greedy, verifier="test_exact_text", pass_k=(1, 3, 8))
    # greedy: all 3 samples of a prompt agree, so avg@3 = pass@1 = pass@3 = 2/4; pass@8 > k is left out
    assert result.metrics == {"toy": {"num_prompts": 4.0, "avg@3": 0.5, "pass@1": 0.5, "pass@3": 0.5}}
    assert len(result.records) == 12 and {r["score"] for r in result.records if r["index"] == 0} == {1.0}
    table = format_table(result.metrics)
    assert table.splitlines()[0].split() == ["dataset", "prompts", "avg@3", "pass@1", "pass@3"]
    assert table.splitlines()[2].split() == ["toy", "4", "0.5000", "0.5000", "0.5000"]


def test_row_verifier_overrides_the_default(tmp_path, engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    # the default verifier fails both rows (no response is "<never>"); only the first row names another
    rows = [{"prompt": "1+1=", "answer": "<never>", "type": "test_always"}, {"prompt": "2+2=", "answer": "<never>"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [EvalSet("m", PromptDataset(str(tmp_path / "d.jsonl")), k=2)]
    encode = lambda p: encode_prompt(tok, p, apply_chat_template=False)  # noqa: E731
    result = evaluate(
        engine, encode, sets, SamplingParams(max_new_tokens=3, temperature=1.0, seed=1), verifier="test_exact_text"
    )
    scores = {(r["index"], r["score"]) for r in result.records}
    assert scores == {(0, 1.0), (1, 0.0)}  # row 0 scored by its own verifier, row 1 by the default
    assert result.metrics["m"]["pass@1"] == 0.5


@pytest.mark.parametrize("deterministic", [False, True])
def test_seeded_eval_through_sglang_draws_k_different_samples(tmp_path, deterministic):
    # By default one n request without the seed (SGLang ignores seeds then); a deterministic server
    # gives all k copies of a request one sampling_seed (identical samples), so the deterministic
    # engine sends seed + j to sample j. Checked over HTTP against the SGLang test double.
    from armor_megatron.rollout.sglang.engine import SGLangEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
    from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint

    path = str(tmp_path / "policy")
    _, tok = make_tiny_checkpoint(path, seed=0, sharpen=8.0)
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    sets = [EvalSet("m", PromptDataset(str(tmp_path / "d.jsonl")), k=4)]
    encode = lambda p: encode_prompt(tok, p, apply_chat_template=False)  # noqa: E731
    with SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path, deterministic=deterministic) as server:
        engine = SGLangEngine([server.url], deterministic=deterministic)
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=3)
        result = evaluate(engine, encode, sets, sampling, verifier="test_exact_text", pass_k=(1,))
        engine.shutdown()
    assert len({r["response"] for r in result.records}) == 4


def test_sample_metrics_hook_adds_its_values_to_each_sets_metrics(tmp_path, engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    encode = lambda p: encode_prompt(tok, p, apply_chat_template=False)  # noqa: E731
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ("1+", "2+")))
    sets = [EvalSet("toy", PromptDataset(str(tmp_path / "d.jsonl")), k=2)]
    hook = lambda samples: {"n": len(samples), "score_sum": sum(s["score"] for s in samples)}  # noqa: E731
    result = evaluate(
        engine, encode, sets, SamplingParams(max_new_tokens=2), verifier="test_always", sample_metrics=hook
    )
    assert result.metrics["toy"]["n"] == 4.0 and result.metrics["toy"]["score_sum"] == 4.0


def test_a_verl_parquet_is_scored_by_a_verl_compute_score_unchanged(tmp_path, engine_and_tokenizer):
    """verl's layout (nested reward_model.ground_truth, data_source, extra_info) reaches verl's signature."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    engine, tok = engine_and_tokenizer
    encode = lambda p: encode_prompt(tok, p, apply_chat_template=False)  # noqa: E731
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompts = ["1+1=", "2+2=", "3+3="]
    outputs = [g[0].text for g in engine.generate([encode(p) for p in prompts], n=1, sampling=greedy)]
    rows = [
        {
            "data_source": "toy",
            "prompt": p,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": out if i < 2 else "<never>"},
            "extra_info": {"split": "test", "index": i, "weight": 0.25 * (i + 1)},
        }
        for i, (p, out) in enumerate(zip(prompts, outputs))
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    dataset = PromptDataset(str(tmp_path / "verl.parquet"), answer_key="reward_model.ground_truth")
    assert dataset[1].reward_fields()["row"] == rows[1]  # the whole row, as the file holds it
    result = evaluate(
        engine,
        encode,
        [EvalSet("verl", dataset, k=2)],
        greedy,
        verifier="tests.rewards.row_verifiers:weighted_by_source",
    )
    assert [r["score"] for r in result.records] == [0.25, 0.25, 0.5, 0.5, 0.0, 0.0]  # weights from extra_info
