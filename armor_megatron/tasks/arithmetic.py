r"""A synthetic verifiable task for tiny CPU runs: integer addition answered in ``\boxed{}``.

Prompt ``"17+25="``, answer ``"42"``; a correct response is ``"\boxed{42}"`` followed by EOS,
so the product's own math verifier scores it. The tokenizer is built locally (no downloads):
one token per character of a small alphabet plus ``\boxed{`` as a single token, which keeps
responses 4–5 tokens long.
"""

from __future__ import annotations

import json
import os
import random

from armor_megatron.tasks.tokenizer import build_char_tokenizer

BOXED = "\\boxed{"
ALPHABET = "0123456789+-*=}? "


def build_tokenizer():
    r"""Ids 0..2 are <pad>, <eos>, <unk>, then ``\boxed{``, then one id per character of ``ALPHABET``."""
    return build_char_tokenizer(ALPHABET, multi_char_tokens=(BOXED,))


def make_problems(n: int, *, seed: int, max_operand: int = 30) -> list[dict]:
    """``n`` addition problems ``{"prompt": "a+b=", "answer": "a+b", "type": "math"}``, seeded."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "type": "math"})
    return rows


def split_problems(num_val: int, *, seed: int, max_operand: int = 30) -> tuple[list[dict], list[dict]]:
    """Every problem up to ``max_operand``, shuffled and split into (train, val).

    Every problem with operands in [0, max_operand], shuffled, split into (train, val) with
    ``num_val`` validation problems that never appear in train.
    """
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "type": "math"}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    random.Random(seed).shuffle(rows)
    if not 0 < num_val < len(rows):
        raise ValueError(f"num_val={num_val} must be in (0, {len(rows)}) for max_operand={max_operand}")
    return rows[num_val:], rows[:num_val]


def solution(row: dict) -> str:
    """The reference solution text of a problem (what supervised warm-up teaches)."""
    return f"{BOXED}{row['answer']}}}"


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Write rows atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
