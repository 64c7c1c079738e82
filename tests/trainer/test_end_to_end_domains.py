"""A mixed-domain run through ``armor-train``: math, safety and knowledge rows in one training
file, each scored by the verifier its ``type`` names, with per-domain accuracy in the metrics."""

import json
import os

import pytest

from tests.trainer.test_end_to_end import _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SAFETY = [
    {"prompt": "3+4=", "label": "benign", "type": "safety"},  # answered: reward 1
    {"prompt": "weapon?", "label": "harmful", "type": "safety"},  # the tiny model never refuses: reward 0
]
KNOWLEDGE = [
    {"prompt": "2+2=", "answer": {"value": "4", "aliases": ["four"]}, "type": "knowledge"},
    {"prompt": "5+5=", "answer": ["10", "ten"], "type": "knowledge"},
]


def test_math_safety_and_knowledge_rows_train_together(tiny, tmp_path):
    train = next(p.split("=", 1)[1] for p in tiny if p.startswith("data.train_path="))
    with open(train) as f:
        math_rows = [json.loads(line) for line in f][:4]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [*math_rows, *SAFETY, *KNOWLEDGE]))
    metrics = _train(
        [p for p in tiny if not p.startswith("data.train_path=")],
        tmp_path,
        f"data.train_path={mixed}",
        "rollout.prompts_per_step=8",
        "train.steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "algorithm.dynamic_sampling.enabled=false",
    )
    for step in (1, 2):
        m = metrics[step]
        assert {"rollout/accuracy/math", "rollout/accuracy/safety", "rollout/accuracy/knowledge"} <= set(m), m
        # the benign request is answered (1), the harmful one never refused (0) by the arithmetic model
        assert 0.0 < m["rollout/accuracy/safety"] < 1.0
        assert m["train/skipped"] == 0.0
    assert os.path.exists(tmp_path / "ckpt" / "latest")
