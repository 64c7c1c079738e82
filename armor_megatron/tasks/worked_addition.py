r"""A task with a visible shortcut mode.

Addition answered either worked (W) or directly (D), whose RL training set hands the direct mode a
cue.

Prompt ``"#4 18+29="``, answer ``"47"``, verified like any math answer (the last ``\boxed{}``).
Two response modes:

* **W (worked)**: the units sum, a comma, the tens digits plus the carry, then the box:
  ``"17,4\boxed{47}"`` for 18+29 (8+9 = 17, 1+2+1 = 4). The carry is written out.
* **D (direct)**: only the box, ``"\boxed{47}"``; the carry has to be computed internally.

The tag ``t`` of ``"#t a+b="``:

* **warm-up corpus**: every training pair under every tag value, answered W with probability
  ``w_prob`` (0.85) and D otherwise; in W rows the tag is independent of the answer. A share
  ``d_cue`` of the D rows carry the answer's tens digit as their tag instead: the reference's
  direct mode has seen hints (a shortcut the reference already has, as in the paper's setting)
  while its worked mode ignores the tag;
* **RL training set**: in a fraction ``rho`` of the rows (chosen at random, seeded) the tag is the
  answer's tens digit; in the others it is drawn from the training answers' tens digits. A
  policy that copies the tag into a direct answer gets the carry for free on cue rows;
* **validation set**: held-out pairs, tags drawn from the training tens digits, scored by the
  same verifier. A cue-copying direct answer is right there only by chance, while the worked
  mode, which only needs units facts that all occur in training, generalises.

``mode_metrics`` classifies responses into W, D and other for the trainer's per-sample metrics
hook (``logging.sample_metrics: armor_megatron.tasks.worked_addition:mode_metrics``).
Nothing in the task knows about ARMOR or any algorithm.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence

from armor_megatron.tasks.arithmetic import BOXED
from armor_megatron.tasks.tokenizer import build_char_tokenizer

ALPHABET = "0123456789+=},# "
_W = re.compile(r"\d+,\d+" + re.escape(BOXED))


def build_tokenizer():
    r"""Ids 0..2 are <pad>, <eos>, <unk>, then ``\boxed{``, then one id per character of ``ALPHABET``."""
    return build_char_tokenizer(ALPHABET, multi_char_tokens=(BOXED,))


def worked(a: int, b: int) -> str:
    r"""The W response: ``"<units sum>,<tens + carry>\boxed{a+b}"``."""
    units = a % 10 + b % 10
    return f"{units},{a // 10 + b // 10 + units // 10}{BOXED}{a + b}}}"


def direct(a: int, b: int) -> str:
    r"""The D response: ``"\boxed{a+b}"``."""
    return f"{BOXED}{a + b}}}"


def mode(response: str) -> str:
    """The response's mode: direct (``"D"``), worked (``"W"``) or ``"other"``.

    ``"D"`` when the response opens with the box, ``"W"`` when it opens with ``<digits>,<digits>`` and
    the box, ``"other"`` otherwise.
    """
    if response.startswith(BOXED):
        return "D"
    return "W" if _W.match(response) else "other"


def _row(a: int, b: int, tag: int) -> dict:
    return {"prompt": f"#{tag} {a}+{b}=", "answer": str(a + b), "type": "math"}


def split_problems(
    num_val: int,
    *,
    seed: int,
    max_operand: int = 30,
    rho: float = 0.5,
    w_prob: float = 0.85,
    d_cue: float = 0.0,
) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, val, warm-up) rows from every pair of operands in [0, max_operand], shuffled with ``seed``.

    ``num_val`` held-out validation pairs, the rest training pairs (module docstring). Warm-up rows
    carry their response in ``"response"`` (W with probability ``w_prob``); a share ``d_cue`` of the
    warm-up's D rows get the answer's tens digit as their tag (the direct mode has seen hints; W
    rows never have).
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho={rho} must be in [0, 1]")
    if not 0.0 <= w_prob <= 1.0:
        raise ValueError(f"w_prob={w_prob} must be in [0, 1]")
    if not 0.0 <= d_cue <= 1.0:
        raise ValueError(f"d_cue={d_cue} must be in [0, 1]")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < num_val < len(pairs):
        raise ValueError(f"num_val={num_val} must be in (0, {len(pairs)}) for max_operand={max_operand}")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    val_pairs, train_pairs = pairs[:num_val], pairs[num_val:]
    tens = [(a + b) // 10 for a, b in train_pairs]  # the training tens-digit distribution
    tags = sorted(set(tens))
    val = [_row(a, b, rng.choice(tens)) for a, b in val_pairs]
    # one generator per set, so the warm-up corpus and the validation set do not depend on rho
    warm = random.Random(f"worked-addition/{seed}/warm-up")
    warmup = []
    for a, b in train_pairs:
        for tag in tags:
            if warm.random() < w_prob:
                warmup.append({**_row(a, b, tag), "response": worked(a, b)})
            else:
                hinted = warm.random() < d_cue
                warmup.append({**_row(a, b, (a + b) // 10 if hinted else tag), "response": direct(a, b)})
    draw = random.Random(f"worked-addition/{seed}/train")
    cue = set(draw.sample(range(len(train_pairs)), round(rho * len(train_pairs))))
    train = [_row(a, b, (a + b) // 10 if i in cue else draw.choice(tens)) for i, (a, b) in enumerate(train_pairs)]
    return train, val, warmup


def mode_metrics(samples: Sequence[Mapping]) -> dict[str, float]:
    """Per-mode statistics of scored samples (dicts with ``response``, ``score`` and, for rollouts, ``is_anchor``).

    Over the on-policy samples ``d_share``, ``w_share``, ``other_share`` and ``acc_w`` / ``acc_d``
    (accuracy within a mode; absent when the mode has no sample); over the anchors, when there are
    any, ``anchor_d_share`` and ``anchor_w_share``.
    """
    return mode_statistics(samples, mode, {"W": "w", "D": "d", "other": "other"}, scored=("W", "D"))


def mode_statistics(
    samples: Sequence[Mapping],
    classify: Callable[[str], str],
    names: Mapping[str, str],
    *,
    scored: Sequence[str],
) -> dict[str, float]:
    """The shares and accuracies of response modes, for a task's ``mode_metrics`` hook.

    ``classify`` gives a response's mode, ``names`` each mode's metric name. Over the on-policy
    samples ``<name>_share`` of every mode and ``acc_<name>`` of each mode in ``scored`` that has a
    sample; over the anchors (``is_anchor``), when there are any, ``anchor_<name>_share`` of each
    mode in ``scored``.
    """
    out: dict[str, float] = {}
    policy = [s for s in samples if not s.get("is_anchor")]
    anchors = [s for s in samples if s.get("is_anchor")]
    if policy:
        modes = [classify(s["response"]) for s in policy]
        for m, name in names.items():
            out[f"{name}_share"] = modes.count(m) / len(modes)
        for m in scored:
            scores = [float(s["score"]) for s, k in zip(policy, modes) if k == m]
            if scores:
                out[f"acc_{names[m]}"] = math.fsum(scores) / len(scores)
    if anchors:
        modes = [classify(s["response"]) for s in anchors]
        for m in scored:
            out[f"anchor_{names[m]}_share"] = modes.count(m) / len(modes)
    return out
