"""A character-level tokenizer built locally (no downloads), for tiny models in runs and tests."""

from __future__ import annotations

import re
from collections.abc import Sequence

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def build_char_tokenizer(alphabet: str, multi_char_tokens: Sequence[str] = ()):
    r"""A character-level ``PreTrainedTokenizerFast`` with a few multi-character tokens.

    A ``PreTrainedTokenizerFast`` with ids 0..2 = <pad>, <eos>, <unk>, then each of
    ``multi_char_tokens`` (kept whole, e.g. ``\boxed{``), then one id per character of ``alphabet``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for tok in (*multi_char_tokens, *alphabet):
        vocab.setdefault(tok, len(vocab))
    pattern = "|".join([*(re.escape(t) for t in multi_char_tokens), "."])
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
