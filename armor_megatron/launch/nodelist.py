"""Expand SLURM compressed host lists, the form of ``SLURM_JOB_NODELIST``.

    expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]

Rules (those of ``scontrol show hostnames``): hosts are separated by commas outside brackets;
a bracket holds comma-separated numbers or ``lo-hi`` ranges, and a range keeps the zero padding
of its lower bound (``[08-10]`` -> 08 09 10); several bracket groups in one name expand as a
product in order (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). Order and duplicates are kept as written.
"""

from __future__ import annotations

import itertools
import re

from armor_megatron.errors import UserInputError


class NodeListError(UserInputError):
    """A host list that is not in SLURM's compressed form."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list (``node[01-03,07],gpu5``), in order."""
    text = nodelist.strip()
    if not text:
        raise NodeListError("empty SLURM node list")
    hosts: list[str] = []
    for name in _split_outside_brackets(text):
        pieces = re.split(r"(\[[^\[\]]*\])", name)
        if any("[" in p or "]" in p for p in pieces if not p.startswith("[")):
            raise NodeListError(f"cannot parse SLURM node list {nodelist!r}: unbalanced brackets in {name!r}")
        choices = [_expand_bracket(p, nodelist) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise NodeListError(f"cannot parse SLURM node list {text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise NodeListError(f"cannot parse SLURM node list {text!r}: unbalanced brackets")
    parts.append(text[start:])
    if any(not p.strip() for p in parts):
        raise NodeListError(f"cannot parse SLURM node list {text!r}: empty host name")
    return [p.strip() for p in parts]


def _expand_bracket(group: str, nodelist: str) -> list[str]:
    out = []
    for item in group[1:-1].split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise NodeListError(f"cannot parse SLURM node list {nodelist!r}: bad range {item!r} in {group}")
        if not sep:
            out.append(lo)
        elif int(hi) < int(lo):
            raise NodeListError(f"cannot parse SLURM node list {nodelist!r}: range {item!r} runs backwards")
        else:
            out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out
