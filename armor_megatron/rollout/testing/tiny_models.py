"""Tiny causal LMs with a locally built character tokenizer, for tests and benchmarks.

Nothing is downloaded: the tokenizer is a character-level ``tokenizers`` WordLevel model
over a fixed alphabet and the model is a randomly initialised 2-layer Qwen2 (or Llama).
``sharpen`` scales ``lm_head`` so the model is confident: its most likely next token gets
most of the probability, which makes "the reference can solve this prompt" a controllable
property in anchor tests.
"""

from __future__ import annotations

import os
from typing import Tuple

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
ALPHABET = "0123456789+-=? abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer(alphabet: str = ALPHABET):
    """A ``PreTrainedTokenizerFast``: ids 0..2 are <pad>, <eos>, <unk>, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(vocab_size: int, family: str = "qwen2", hidden_size: int = 32, num_layers: int = 2) -> dict:
    """HF ``config.json`` dict of a tiny decoder (2 heads of 16, 2 KV heads... see values)."""
    cfg = {
        "model_type": family,
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if family == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def tiny_weights(cfg: dict, seed: int = 0, sharpen: float = 1.0):
    """``[(HF name, tensor)]`` of a freshly initialised model of ``cfg`` (seeded), ``lm_head`` scaled by ``sharpen``."""
    import torch

    from armor_megatron.rollout.hf_checkpoint import build_causal_lm

    torch.manual_seed(seed)
    model = build_causal_lm(cfg)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return [(n, t * sharpen if n == "lm_head.weight" else t) for n, t in named]


def make_tiny_checkpoint(directory: str, seed: int = 0, sharpen: float = 1.0, family: str = "qwen2") -> Tuple[dict, object]:
    """Write a tiny HF checkpoint (config, safetensors, tokenizer) to ``directory``; returns (config, tokenizer)."""
    from armor_megatron.rollout.hf_checkpoint import write_hf_checkpoint

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(len(tokenizer), family=family)
    write_hf_checkpoint(directory, tiny_weights(cfg, seed=seed, sharpen=sharpen), cfg)
    tokenizer.save_pretrained(directory)
    return cfg, tokenizer


def encode(tokenizer, text: str) -> list:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def exists(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))
