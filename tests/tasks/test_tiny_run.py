import json
import os

import pytest

from armor_megatron.config import load_config
from armor_megatron.models import ModelArch, load_hf_config
from armor_megatron.tasks.arithmetic import split_problems
from armor_megatron.tasks.tiny_run import prepare_tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_split_is_disjoint_and_complete():
    train, val = split_problems(10, seed=0, max_operand=5)
    assert len(train) + len(val) == 36 and len(val) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}


def _config(name: str, tmp_path):
    """``configs/<name>`` with its model, training set and validation set under ``tmp_path``."""
    return load_config(
        os.path.join(ROOT, "configs", name),
        [
            f"model.path={tmp_path}/hf",
            f"data.train_path={tmp_path}/train.jsonl",
            f"eval.datasets=[{{name: val, path: {tmp_path}/val.jsonl, k: 1}}]",
        ],
    )


def test_prepare_writes_a_loadable_model_of_the_configs_arch_and_the_data(tmp_path):
    cfg = _config("tiny_cpu.yaml", tmp_path)
    rows = prepare_tiny_run(cfg, num_val=8, warmup_steps=2, log=None)
    arch = ModelArch.from_hf_config(load_hf_config(str(tmp_path / "hf")))
    assert arch == ModelArch.from_hf_config({**cfg.model.arch, "torch_dtype": "float32"})
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors") and os.path.isfile(tmp_path / "hf" / "tokenizer.json")
    val = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert val == rows["val"] and len(val) == 8
    # a second call keeps the existing model (it is only rewritten when missing)
    mtime = os.path.getmtime(tmp_path / "hf" / "model.safetensors")
    prepare_tiny_run(cfg, num_val=8, warmup_steps=2, log=None)
    assert os.path.getmtime(tmp_path / "hf" / "model.safetensors") == mtime


def test_an_unknown_task_is_refused_naming_the_known_ones(tmp_path):
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
        [f"model.path={tmp_path}/hf", f"data.train_path={tmp_path}/t.jsonl"],
    )
    with pytest.raises(ValueError, match="unknown tiny task 'sums'; known: arithmetic, tagged_addition"):
        prepare_tiny_run(cfg, task="sums", log=None)


def test_tagged_addition_warms_up_on_its_own_corpus_and_writes_its_splits(tmp_path):
    cfg = _config("tiny_overopt.yaml", tmp_path)
    rows = prepare_tiny_run(cfg, task="tagged_addition", num_val=8, warmup_steps=2, log=None)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert train == rows["train"] and all(r["prompt"].startswith("#") for r in train)
    assert json.loads((tmp_path / "hf" / "armor_tiny_run.json").read_text())["task"] == "tagged_addition"


def test_a_model_made_for_another_recipe_is_rebuilt(tmp_path):
    cfg = _config("tiny_cpu.yaml", tmp_path)  # every path under tmp_path, the validation set's too
    prepare_tiny_run(cfg, num_val=8, warmup_steps=1, log=None)
    lines = []
    prepare_tiny_run(cfg, task="tagged_addition", num_val=8, warmup_steps=1, log=lines.append)
    assert lines[0] == f"rebuilding {tmp_path}/hf: it was made for another recipe"
    recipe = json.loads((tmp_path / "hf" / "armor_tiny_run.json").read_text())
    assert recipe["task"] == "tagged_addition" and recipe["arch"]["hidden_size"] == cfg.model.arch["hidden_size"]
    assert not os.path.exists(tmp_path / "hf.tmp")


def test_worked_addition_warms_up_on_its_rows_own_responses_and_its_options_enter_the_recipe(tmp_path):
    cfg = _config("tiny_overopt_worked.yaml", tmp_path)
    prepare_tiny_run(cfg, task="worked_addition", num_val=8, warmup_steps=1, options={"rho": 1.0}, log=None)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert all(int(r["prompt"][1]) == int(r["answer"]) // 10 for r in train)  # ρ = 1: every tag is the cue
    first = json.loads((tmp_path / "hf" / "armor_tiny_run.json").read_text())
    assert first["task"] == "worked_addition" and len(first["warmup_corpus_sha256"]) == 64
    # ρ changes only the training tags: the warm-up model is kept; another W share rebuilds it
    lines = []
    prepare_tiny_run(cfg, task="worked_addition", num_val=8, warmup_steps=1, options={"rho": 0.0}, log=lines.append)
    assert lines == []
    options = {"rho": 0.0, "w_prob": 0.5}
    prepare_tiny_run(cfg, task="worked_addition", num_val=8, warmup_steps=1, options=options, log=lines.append)
    assert lines[0] == f"rebuilding {tmp_path}/hf: it was made for another recipe"
