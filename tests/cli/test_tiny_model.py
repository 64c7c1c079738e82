"""``armor-convert tiny-model OUT_DIR``: a random tiny HF model whose tokenizer has a chat template, ready for a run."""

import json
import os

import pytest
import torch

from armor_megatron.cli.convert import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny") / "model")
    assert main(["tiny-model", out, "--hidden-size", "16", "--context", "256"]) == 0
    return out


def test_it_loads_in_transformers_and_applies_its_chat_template(model_dir):
    import transformers

    from armor_megatron.data.prompts import encode_prompt
    from armor_megatron.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # as the trainer and the local engine load it
    messages = [{"role": "user", "content": "What is 2+3? Put it in \\boxed{}.\n(A) 5"}]
    ids = encode_prompt(tokenizer, messages)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.eos_token_id == tokenizer.eos_token_id and model.config.max_position_embeddings == 256
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()


def test_a_run_on_the_users_own_chat_data_passes_the_check(model_dir, tmp_path):
    from armor_megatron.config import load_config
    from armor_megatron.config.files import check_files

    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+3?"}], "answer": str(i + 3)} for i in range(4)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"model.path={model_dir}",
        f"data.train_path={tmp_path / 'mine.jsonl'}",
        "data.apply_chat_template=true",
        "eval.datasets=[]",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    assert check_files(load_config(TINY, overrides)) == []


def test_an_existing_directory_is_kept_unless_overwrite(model_dir, capsys):
    assert main(["tiny-model", model_dir]) == 2
    err = capsys.readouterr().err
    assert err == f"armor-convert: error: {model_dir} exists and is not empty; pass --overwrite to replace it\n"
    assert main(["tiny-model", model_dir, "--hidden-size", "18"]) == 2
    assert "--hidden-size 18: must be a positive multiple of 4" in capsys.readouterr().err
