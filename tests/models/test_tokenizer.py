"""A checkpoint's tokenizer loads as declared: transformers 5 rebuilds a generic fast tokenizer as
the family's class (Qwen2Tokenizer for model_type qwen2) and loses its pre-tokenizer."""

import json

from armor_megatron.models.tokenizer import load_tokenizer
from armor_megatron.tasks.tagged_addition import build_tokenizer

TEXT = "#7 18+29=\\boxed{47}"


def save_tiny_checkpoint_tokenizer(path, model_type="qwen2"):
    tok = build_tokenizer()
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["Qwen2ForCausalLM"]}))
    return tok


def test_a_saved_character_tokenizer_round_trips(tmp_path):
    built = save_tiny_checkpoint_tokenizer(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    ids = built.encode(TEXT, add_special_tokens=False)
    assert loaded.encode(TEXT, add_special_tokens=False) == ids
    assert loaded.decode(ids) == TEXT
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)


def test_a_declared_family_tokenizer_still_goes_through_auto_tokenizer(tmp_path):
    save_tiny_checkpoint_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(str(tmp_path))).__name__ == "Qwen2Tokenizer"
