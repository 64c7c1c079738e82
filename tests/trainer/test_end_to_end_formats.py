"""Datasets as other frameworks write them, trained as they are through ``armor-train`` with the
overrides ``docs/data.md`` gives: a verl parquet (chat-message ``prompt``, the answer in
``reward_model.ground_truth``, ``data_source``) and a slime JSONL (chat-message ``prompt``, the
answer in ``label``)."""

import json
import os
import shutil

import pytest

from tests.trainer.test_end_to_end import ROOT, _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DOC = os.path.join(ROOT, "docs", "data.md")
VERL_OVERRIDES = ["data.answer_key=reward_model.ground_truth", "data.apply_chat_template=true"]
SLIME_OVERRIDES = ["data.answer_key=label", "data.apply_chat_template=true"]
# a chat template that only joins the messages' text: the tiny model sees the prompts it was warmed up on
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def chat_model(tiny, tmp_path_factory):
    """The tiny model's directory, its tokenizer given a chat template; the tiny run's training rows."""
    from transformers import AutoTokenizer

    source = next(p.split("=", 1)[1] for p in tiny if p.startswith("model.path="))
    model = tmp_path_factory.mktemp("chat") / "hf"
    shutil.copytree(source, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    train = next(p.split("=", 1)[1] for p in tiny if p.startswith("data.train_path="))
    with open(train) as f:
        rows = [json.loads(line) for line in f][:32]
    return model, rows


def _run(chat_model, tmp_path, data_file, overrides, *evaluation):
    with open(DOC) as f:
        doc = f.read()
    assert all(o in doc for o in overrides), f"docs/data.md no longer gives {overrides}"
    model, _ = chat_model
    return _train(
        [f"model.path={model}"],
        tmp_path,
        f"data.train_path={data_file}",
        *overrides,
        "parallelism.tp=1",
        "train.steps=2",
        "checkpoint.every_steps=0",
        *(evaluation or ["eval.every_steps=0", "eval.datasets=[]"]),
    )


def _trained(metrics):
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["train/num_tokens"] > 0 and metrics[step]["train/skipped"] == 0.0
        assert "rollout/accuracy/math" in metrics[step]


def test_a_verl_parquet_trains_as_it_is(chat_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"index": i, "split": "train"},
        }
        for i, r in enumerate(chat_model[1])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    # validated on a plain JSONL with its own columns, as the 7B recipe's MATH-500 / AIME sets
    (tmp_path / "val.jsonl").write_text(
        "".join(json.dumps({"problem": r["prompt"], "answer": r["answer"]}) + "\n" for r in chat_model[1][:8])
    )
    val = f"{{name: val, path: {tmp_path / 'val.jsonl'}, k: 1, prompt_key: problem, answer_key: answer}}"
    metrics = _run(
        chat_model, tmp_path, tmp_path / "train.parquet", VERL_OVERRIDES, "eval.every_steps=2", f"eval.datasets=[{val}]"
    )
    assert "eval/val/pass@1" in metrics[2]
    _trained({step: m for step, m in metrics.items() if step})


def test_a_slime_jsonl_trains_as_it_is(chat_model, tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["answer"], "metadata": {"id": i}}
        for i, r in enumerate(chat_model[1])
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _trained(_run(chat_model, tmp_path, tmp_path / "train.jsonl", SLIME_OVERRIDES))
