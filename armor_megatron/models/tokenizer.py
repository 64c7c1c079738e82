"""Load a checkpoint's tokenizer as the checkpoint declares it.

transformers 5 resolves ``AutoTokenizer`` by the model's ``model_type`` for several families
(qwen2 among them): a checkpoint whose ``tokenizer_config.json`` declares the generic fast
tokenizer (``TokenizersBackend`` / ``PreTrainedTokenizerFast``, what ``save_pretrained`` of a
tokenizer built from a ``tokenizers.Tokenizer`` writes) is then rebuilt as ``Qwen2Tokenizer``
from its vocabulary alone, dropping the pre-tokenizer of ``tokenizer.json``. A character-level
tokenizer then silently loses its spaces and multi-character tokens on encode. Such checkpoints
are loaded from their ``tokenizer.json`` as declared; every other one through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
import os
from typing import Any

GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the HF directory ``path``."""
    import transformers

    config = os.path.join(path, "tokenizer_config.json")
    declared = None
    if os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        with open(config) as f:
            declared = json.load(f).get("tokenizer_class")
    if declared in GENERIC_FAST:
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)
