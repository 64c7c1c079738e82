"""Tiny causal LMs with a locally built character tokenizer, for tests and benchmarks.

Nothing is downloaded: the tokenizer is a character-level ``tokenizers`` WordLevel model
over a fixed alphabet and the model is a randomly initialised 2-layer Qwen2 (or Llama).
``sharpen`` scales ``lm_head`` so the model is confident: its most likely next token gets
most of the probability, which makes "the reference can solve this prompt" a controllable
property in anchor tests.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from armor_megatron.tasks import tokenizer as _char_tokenizer

ALPHABET = "0123456789+-=? abcdefghijklmnopqrstuvwxyz"
CHAT_ALPHABET = "".join(c for c in string.printable if c not in "\r\x0b\x0c")  # printable ASCII, tab, newline
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")  # ChatML's, each one token; <|im_end|> is the end of sequence
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str = ALPHABET) -> Any:
    """A ``PreTrainedTokenizerFast``: ids 0..2 are <pad>, <eos>, <unk>, then one id per character."""
    return _char_tokenizer.build_char_tokenizer(alphabet)


def tiny_config(vocab_size: int, family: str = "qwen2", hidden_size: int = 32, num_layers: int = 2) -> dict[str, Any]:
    """HF ``config.json`` dict of a tiny decoder: 4 query heads, 2 KV heads, head_dim = hidden_size / 4."""
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


def tiny_weights(cfg: dict[str, Any], seed: int = 0, sharpen: float = 1.0) -> list[tuple[str, Any]]:
    """``[(HF name, tensor)]`` of a freshly initialised model of ``cfg`` (seeded), ``lm_head`` scaled by ``sharpen``."""
    import torch

    from armor_megatron.rollout.hf_checkpoint import build_causal_lm

    torch.manual_seed(seed)
    model = build_causal_lm(cfg)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return [(n, t * sharpen if n == "lm_head.weight" else t) for n, t in named]


def make_tiny_checkpoint(
    directory: str, seed: int = 0, sharpen: float = 1.0, family: str = "qwen2", hidden_size: int = 32
) -> tuple[dict[str, Any], Any]:
    """Write a tiny HF checkpoint (config, safetensors, tokenizer) to ``directory``; returns (config, tokenizer)."""
    from armor_megatron.rollout.hf_checkpoint import write_hf_checkpoint

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(len(tokenizer), family=family, hidden_size=hidden_size)
    write_hf_checkpoint(directory, tiny_weights(cfg, seed=seed, sharpen=sharpen), cfg)
    tokenizer.save_pretrained(directory)
    return cfg, tokenizer


def build_chat_tokenizer() -> Any:
    """A character tokenizer over printable ASCII with ChatML's markers and chat template; ``<|im_end|>`` ends a turn.

    Ids 0..2 are <pad>, <eos>, <unk>, then the two markers, then one id per character; other
    characters (beyond ASCII) become <unk>.
    """
    tokenizer = _char_tokenizer.build_char_tokenizer(CHAT_ALPHABET, CHAT_MARKERS)
    tokenizer.eos_token = CHAT_MARKERS[1]
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_chat_model(
    directory: str,
    *,
    family: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    context: int = 2048,
    seed: int = 0,
) -> dict[str, Any]:
    """Write a randomly initialised tiny HF model with `build_chat_tokenizer`'s tokenizer to ``directory``; its config.

    A model to try a dataset, a verifier or an environment end to end on a CPU: it reads chat
    prompts (``data.apply_chat_template``) and any printable ASCII, and has learnt nothing.
    ``context``: ``max_position_embeddings``.
    """
    from armor_megatron.rollout.hf_checkpoint import write_hf_checkpoint

    tokenizer = build_chat_tokenizer()
    cfg = tiny_config(len(tokenizer), family=family, hidden_size=hidden_size, num_layers=num_layers)
    cfg.update(
        max_position_embeddings=context,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    write_hf_checkpoint(directory, tiny_weights(cfg, seed=seed), cfg)
    tokenizer.save_pretrained(directory)
    return cfg


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m armor_megatron.rollout.testing.tiny_models --out DIR``: write a tiny checkpoint (used by gpu_smoke.sh)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="qwen2", choices=("qwen2", "llama"))
    ap.add_argument(
        "--hidden-size", type=int, default=256, help="256 gives head_dim 64, which GPU attention kernels support"
    )
    ap.add_argument("--sharpen", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    make_tiny_checkpoint(
        args.out, seed=args.seed, sharpen=args.sharpen, family=args.family, hidden_size=args.hidden_size
    )
    print(args.out)


if __name__ == "__main__":
    main()
