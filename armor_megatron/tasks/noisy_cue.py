r"""Addition with a quoted answer tag that a rare, imperfect shortcut mode copies.

Prompt ``"#47 18+29="``: the tag quotes a candidate answer. Three response modes:

* **W (worked)**, the generalising mode: units sum, comma, tens plus carry, then the box,
  ``"17,4\boxed{47}"`` (as in ``worked_addition``); it ignores the tag;
* **C (copy)**, the shortcut: ``"#\boxed{47}"``, the tag copied into the box. Right exactly when
  the tag is;
* **D (direct)**: the box only; the warm-up never teaches it.

Two designs share one warm-up (``design``):

* ``rare_cue``: every RL training row is tagged, right with probability ``q`` (0.85), else a
  near miss (the answer ± 1 or ± 10). The copy mode starts rare (``copy_prob`` of the warm-up)
  and pays more than W on training rows (q against W's accuracy), so DAPO should learn it only
  after W has improved; validation tags are always near misses, where C is always wrong.
* ``dormant``: RL rows come in file order (``data.shuffle: false``): the first ``tagless_rows``
  rows carry no tag, so RL first improves W; then truthful tags ramp in linearly over
  ``ramp_rows`` rows up to ``q``. The shift is imposed: this design tests whether anchors protect
  a mode against a shortcut that arrives later, not over-optimisation that arises by itself.

Warm-up corpus (per training pair): ``tags_per_pair`` tagged rows, each a copy row with
probability ``copy_prob`` (tag right, response C) and otherwise a worked row whose tag is right
with probability ``warm_right`` (0.5) and else a random wrong answer; plus one tagless worked row
(``"18+29="``), so tagless prompts are in the reference's distribution. The copy mode is thus
rare and, seen from the tag alone, unreliable: the reference cannot tell when copying pays.

Validation: held-out pairs with near-miss tags (``val``), and the same pairs without tags
(``tagless_val``: W's accuracy with no cue, for the forced-worked check). ``mode_metrics`` is the
trainer's per-sample metrics hook (``logging.sample_metrics:
armor_megatron.tasks.noisy_cue:mode_metrics``). Nothing here knows about ARMOR.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence

from armor_megatron.errors import UserInputError
from armor_megatron.tasks.arithmetic import BOXED
from armor_megatron.tasks.worked_addition import build_tokenizer, mode_statistics, worked

__all__ = ["DESIGNS", "build_tokenizer", "copy", "mode", "mode_metrics", "split_problems", "tagless_rows"]

DESIGNS = ("rare_cue", "dormant")
COPY_PREFIX = "#"  # the copy mode's first token: forcing it gives the shortcut's forced accuracy
_W = re.compile(r"\d+,\d+" + re.escape(BOXED))


class NoisyCueError(UserInputError):
    """An option of the noisy-cue task is out of range."""


def copy(tag: int) -> str:
    r"""The C response: ``"#\boxed{<tag>}"``."""
    return f"{COPY_PREFIX}{BOXED}{tag}}}"


def mode(response: str) -> str:
    """``"C"`` (opens with ``#``), ``"W"`` (``<digits>,<digits>`` then the box), ``"D"`` (the box), or ``"other"``."""
    if response.startswith(COPY_PREFIX):
        return "C"
    if response.startswith(BOXED):
        return "D"
    return "W" if _W.match(response) else "other"


def slipped(a: int, b: int, rng: random.Random) -> str:
    r"""A worked response with one slip: the tens line off by one, the box consistent with it (wrong).

    ``slipped(18, 29)`` is ``"17,3\boxed{37}"`` or ``"17,5\boxed{57}"``; never negative.
    """
    units = a % 10 + b % 10
    tens = a // 10 + b // 10 + units // 10
    wrong = tens + rng.choice([-1, 1]) if tens > 0 else tens + 1
    return f"{units},{wrong}{BOXED}{wrong * 10 + units % 10}}}"


def _row(a: int, b: int, tag: int | None) -> dict:
    prompt = f"{a}+{b}=" if tag is None else f"#{tag} {a}+{b}="
    return {"prompt": prompt, "answer": str(a + b), "type": "math"}


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong tag close to ``answer``: answer ± 1 or ± 10, never negative."""
    return rng.choice([t for t in (answer - 10, answer - 1, answer + 1, answer + 10) if t >= 0])


def _check(name: str, value: float, lo: float = 0.0, hi: float = 1.0) -> None:
    if not lo <= value <= hi:
        raise NoisyCueError(f"noisy_cue: {name}={value} must be in [{lo}, {hi}]")


def split_problems(
    num_val: int,
    *,
    seed: int,
    max_operand: int = 30,
    design: str = "rare_cue",
    q: float = 0.85,
    copy_prob: float = 0.03,
    warm_right: float = 0.5,
    tags_per_pair: int = 8,
    tagless_rows: int = 1600,
    ramp_rows: int = 1600,
    train_rows: int = 6400,
    rl_pairs: int = 0,
    copy_drills: int = 0,
    w_slip: float = 0.0,
) -> tuple[list[dict], list[dict], list[dict]]:
    r"""(train, val, warm-up) rows of ``design`` (module docstring), shuffled with ``seed``.

    Every pair of operands in [0, ``max_operand``]; ``num_val`` pairs held out for validation. With
    ``rl_pairs`` > 0 that many other pairs are RL's alone (the warm-up never sees them, as a base
    model never saw the RL set) and the warm-up takes the rest; with 0, warm-up and RL share the
    training pairs. ``copy_drills`` warm-up rows ``"#47 ="`` → ``"#\boxed{47}"`` (no problem to
    solve, so they teach the copy skill without making the copy mode common on problems).
    A share ``w_slip`` of the worked warm-up rows carry a slip (:func:`slipped`): the reference's
    worked mode is sloppy, with room for RL to improve it. ``rare_cue``: one RL row per training pair. ``dormant``: ``train_rows`` rows in the order RL must read them
    (``tagless_rows`` tagless, then a linear ramp of tagged rows over ``ramp_rows``, then tagged at
    ``q``); a tagged row's tag is right with the ramp's probability, else a near miss.
    """
    if design not in DESIGNS:
        raise NoisyCueError(f"noisy_cue: unknown design {design!r}; known: {', '.join(DESIGNS)}")
    for name, value in (("q", q), ("copy_prob", copy_prob), ("warm_right", warm_right), ("w_slip", w_slip)):
        _check(name, value)
    if tags_per_pair < 1:
        raise NoisyCueError(f"noisy_cue: tags_per_pair={tags_per_pair} must be >= 1")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not (0 < num_val and rl_pairs >= 0 and num_val + rl_pairs < len(pairs)):
        raise NoisyCueError(
            f"noisy_cue: num_val={num_val} and rl_pairs={rl_pairs} leave no warm-up pair of {len(pairs)} "
            f"for max_operand={max_operand}"
        )
    rng = random.Random(seed)
    rng.shuffle(pairs)
    val_pairs, train_pairs = pairs[:num_val], pairs[num_val:]
    warm_pairs = train_pairs
    if rl_pairs:
        train_pairs, warm_pairs = train_pairs[:rl_pairs], train_pairs[rl_pairs:]
    answers = sorted({a + b for a, b in warm_pairs})
    val = [_row(a, b, near_miss(a + b, rng)) for a, b in val_pairs]

    warm = random.Random(f"noisy-cue/{seed}/warm-up")
    warmup = []
    for a, b in warm_pairs:
        s = a + b

        def worked_row(a: int = a, b: int = b) -> str:
            return slipped(a, b, warm) if warm.random() < w_slip else worked(a, b)

        warmup.append({**_row(a, b, None), "response": worked_row()})
        for _ in range(tags_per_pair):
            if warm.random() < copy_prob:
                warmup.append({**_row(a, b, s), "response": copy(s)})
            else:
                tag = s if warm.random() < warm_right else warm.choice([t for t in answers if t != s])
                warmup.append({**_row(a, b, tag), "response": worked_row()})

    for _ in range(copy_drills):
        tag = warm.choice(answers)
        warmup.append({"prompt": f"#{tag} =", "answer": str(tag), "type": "math", "response": copy(tag)})

    draw = random.Random(f"noisy-cue/{seed}/train/{design}")
    if design == "rare_cue":
        train = [_row(a, b, a + b if draw.random() < q else near_miss(a + b, draw)) for a, b in train_pairs]
        return train, val, warmup
    order: list[tuple[int, int]] = []
    while len(order) < train_rows:  # passes over the training pairs, each in a fresh order
        order += draw.sample(train_pairs, len(train_pairs))
    train = []
    for i, (a, b) in enumerate(order[:train_rows]):
        if i < tagless_rows:
            train.append(_row(a, b, None))
            continue
        right = q * min(1.0, (i - tagless_rows + 1) / max(1, ramp_rows))
        train.append(_row(a, b, a + b if draw.random() < right else near_miss(a + b, draw)))
    return train, val, warmup


def tagless_rows(rows: Sequence[Mapping]) -> list[dict]:
    """``rows`` with their tags removed (``"#47 18+29="`` → ``"18+29="``): the tagless validation set."""
    return [{**r, "prompt": r["prompt"].split(" ", 1)[-1]} for r in rows]


def mode_metrics(samples: Sequence[Mapping]) -> dict[str, float]:
    """Per-mode statistics of scored samples (dicts with ``response``, ``score`` and, for rollouts, ``is_anchor``).

    Over the on-policy samples: ``short_share`` (the copy mode C), ``w_share``, ``d_share``,
    ``other_share`` and ``acc_w`` / ``acc_short`` (accuracy within a mode; absent without a
    sample); over the anchors, when there are any, ``anchor_short_share`` and ``anchor_w_share``.
    """
    names = {"C": "short", "W": "w", "D": "d", "other": "other"}
    return mode_statistics(samples, mode, names, scored=("W", "C"))
