r"""A task a model can solve only through a tool: look a secret up, then answer with it.

Prompt ``"k7?"``: the key 7; answer ``"5"``, a digit drawn at random for each row, independently
of the key, which nothing in the prompt or the weights can know. The environment (`LookupTable`, ``rollout.environment.spec:
armor_megatron.tasks.tool_lookup:LookupTable``) holds the row's entry::

    model:        #7>           a call (the turn ends at the stop string ">")
    environment:  =5            the tool's result (tokenised once, never trained on)
    model:        \boxed{5}     the answer, verified like any math answer

A response that answers at once (``\boxed{...}``) guesses one of 10 digits: right 1 time in 10.
The warm-up corpus (what the model "pretrained" on) holds both modes on fresh rows: a share
``tool_share`` calls the tool and always copies its result, the rest answer at once with a wrong
guess. So the warmed-up policy copies well and what RL has to learn is *whether to call*: the
reward starts near ``tool_share + (1 - tool_share) / 10`` and every group that mixes the modes
carries signal. The value is one symbol so that a 2-layer model learns the copy in warm-up.
`tool_use` measures it (``logging.sample_metrics``): calls per response, the share of responses
that call with the prompt's key, the share that answer without a call.
"""

from __future__ import annotations

import random
from typing import Any

from armor_megatron.tasks.arithmetic import BOXED
from armor_megatron.tasks.tokenizer import build_char_tokenizer

ALPHABET = "0123456789k?#=>} "
CALL, STOP, RESULT = "#", ">", "="


def build_tokenizer():
    r"""Ids 0..2 are <pad>, <eos>, <unk>, then ``\boxed{``, then one id per character of ``ALPHABET``."""
    return build_char_tokenizer(ALPHABET, multi_char_tokens=(BOXED,))


def row(key: int, value: int) -> dict:
    """One dataset row: the prompt names the key, the answer is the table's value for it."""
    return {"prompt": f"k{key}?", "answer": str(value), "key": str(key), "type": "math"}


def observation(value: str) -> str:
    """The tool's result as the model sees it."""
    return f"{RESULT}{value} "


def transcript(r: dict) -> str:
    r"""A response that calls the tool, reads the result and answers (tool result included, for warm-up)."""
    return f"{CALL}{r['key']}{STOP}{observation(r['answer'])}{BOXED}{r['answer']}}}"


def split_problems(
    num_val: int, *, seed: int, max_operand: int = 0, num_train: int = 512, num_warmup: int = 2048, tool_share=0.25
) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, val, warm-up) rows with fresh random values; ``max_operand`` is unused (the tiny-run signature).

    Warm-up rows carry their ``response``: a call transcript for ``tool_share`` of them, else a
    direct answer with a wrong guess (the answer-at-once mode the warmed-up policy starts with).
    """
    rng = random.Random(seed)

    def draw(n: int) -> list[dict]:
        return [row(rng.randrange(10), rng.randrange(10)) for _ in range(n)]

    train, val, warmup = draw(num_train), draw(num_val), draw(num_warmup)
    for r in warmup:
        if rng.random() < tool_share:
            r["response"] = transcript(r)
        else:
            guess = rng.choice([v for v in range(10) if str(v) != r["answer"]])
            r["response"] = f"{BOXED}{guess}}}"
    return train, val, warmup


class LookupTable:
    """``rollout.environment`` of the task: answers each call ``#<key>`` with the table's value (``=?`` for a key it lacks)."""

    def __init__(self, row: dict[str, Any]):
        self.table = {str(row["key"]): str(row["answer"])}

    def step(self, response: str) -> str | None:
        """The result of a call, or None (done) for a turn that calls nothing."""
        if not response.startswith(CALL):
            return None
        return observation(self.table.get(response[len(CALL) :].strip(), "?"))


def _calls(sample: dict) -> list[str]:
    """The keys a response called the tool with, in order."""
    turns = sample.get("trajectory") or ()
    return [t["response"][len(CALL) :].strip() for t in turns if t["response"].startswith(CALL)]


def tool_use(samples: list[dict]) -> dict[str, float]:
    """``logging.sample_metrics``: ``tool_calls`` per response, ``tool_correct_share`` (a call with the prompt's key), ``tool_direct_share`` (no call)."""
    if not samples:
        return {}
    calls = [_calls(s) for s in samples]
    keys = [str(s["prompt"])[1:-1] for s in samples]
    return {
        "tool_calls": sum(map(len, calls)) / len(samples),
        "tool_correct_share": sum(k in c for k, c in zip(keys, calls)) / len(samples),
        "tool_direct_share": sum(not c for c in calls) / len(samples),
    }
