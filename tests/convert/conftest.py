"""Tiny random HF models of every supported family, saved by transformers (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=256,
    max_position_embeddings=256,
)

# family -> (transformers config class name, extra config)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def save_tokenizer(path: str) -> None:
    """A word-level tokenizer built locally (tokenizers), saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(253)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )


def save_tiny_model(family: str, path: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> str:
    """Build a random ``family`` model with transformers and ``save_pretrained`` it to ``path``.

    Every tensor is drawn at random (norm weights around 1), so a swapped or mis-ordered tensor
    changes the logits."""
    import transformers

    config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """family -> HF directory of a tiny fp32 model (saved once per test session)."""
    root = tmp_path_factory.mktemp("hf")
    return {family: save_tiny_model(family, os.path.join(root, family)) for family in FAMILIES}
