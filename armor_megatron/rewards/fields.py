"""What a verifier is given: the fields it names among its parameters, and whether it scores one response or many.

A verifier declares what it wants by parameter name (docs/rewards.md):

=================================  =============================================================
``response`` (``solution_str``)    the generated text, without the prompt
``ground_truth``                   the row's answer field as the file holds it
``prompt``                         the row's prompt (a string or chat messages)
``data_source``, ``extra_info``    the row's columns of these names (verl's); None when absent
``row``                            the whole row, every column, as the file holds it
``trajectory``                     a multi-turn response's turns (a list of mappings); None for
                                   a single-turn response
=================================  =============================================================

Named in the plural (``responses`` or verl's ``solution_strs``), the verifier scores several
responses in one call and returns one score per response, in order:

* **group**: the other fields singular: all responses of one prompt (the G of a training group,
  anchor included; the k of an evaluation prompt), one call per prompt; ``trajectories`` gives
  one trajectory per response;
* **batch**: another field plural too (``ground_truths``, ``prompts``, ``data_sources``,
  ``extra_infos``, ``rows``): every response one verifier scores in a step, one call, each
  field a list aligned with ``responses`` (verl's batch reward function).

A verifier naming none of these takes ``(response, ground_truth)`` positionally, as the first
verifiers did. A parameter without a default that names no field is refused when the verifier
loads, in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from armor_megatron.rewards.spec import VerifierSpecError

ROW_FIELDS = ("prompt", "data_source", "extra_info", "row", "trajectory")
"""The fields a caller may hand a verifier per response, beside the response and the ground truth."""

Scope = Literal["response", "group", "batch"]

_SINGULAR = {"response": "response", "solution_str": "response", "ground_truth": "ground_truth"}
_SINGULAR.update({name: name for name in ROW_FIELDS})
_PLURAL = {
    "responses": "response",
    "solution_strs": "response",
    "ground_truths": "ground_truth",
    "prompts": "prompt",
    "data_sources": "data_source",
    "extra_infos": "extra_info",
    "rows": "row",
    "trajectories": "trajectory",
}
_NAMES = ", ".join(_SINGULAR)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How to call one verifier.

    ``scope``: what one call scores (one response, one prompt's group, a batch);
    ``positional``: the fields passed positionally, in order; ``keywords``: ``(parameter, field)``
    pairs passed by name.
    """

    scope: Scope
    positional: tuple[str, ...]
    keywords: tuple[tuple[str, str], ...]

    @property
    def fields(self) -> frozenset[str]:
        """Every field the verifier is given."""
        return frozenset(self.positional) | frozenset(field for _, field in self.keywords)

    def arguments(self, values: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of one call, from ``values``: field -> value (a list per response where plural)."""
        return tuple(values.get(f) for f in self.positional), {p: values.get(f) for p, f in self.keywords}

    def values(
        self, responses: Sequence[str], ground_truths: Sequence[Any], fields: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """The field values of one call on ``responses`` (one for scope ``response``; one prompt's for ``group``).

        ``fields[i]``: response ``i``'s row fields (keys among :data:`ROW_FIELDS`; a missing one is None).
        A group shares its row, so its first response's fields and ground truth stand for all.
        """
        wanted = self.fields
        if self.scope == "response":
            out = {"response": responses[0], "ground_truth": ground_truths[0]}
            out.update({k: fields[0].get(k) for k in ROW_FIELDS if k in wanted})
            return out
        out = {"response": list(responses), "trajectory": [f.get("trajectory") for f in fields]}
        if self.scope == "batch":
            out["ground_truth"] = list(ground_truths)
            out.update({k: [f.get(k) for f in fields] for k in ROW_FIELDS[:-1] if k in wanted})
        else:
            out["ground_truth"] = ground_truths[0]
            out.update({k: fields[0].get(k) for k in ROW_FIELDS[:-1] if k in wanted})
        return out


LEGACY = CallPlan("response", ("response", "ground_truth"), ())
"""``fn(response, ground_truth)``: a verifier naming no field."""


def call_plan(fn: Callable[..., Any], name: str) -> CallPlan:
    """How to call ``fn``, read from its parameter names (module docstring).

    Raises VerifierSpecError in one line naming verifier ``name`` and the parameter it cannot supply.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return LEGACY  # some builtins have no introspectable signature; trust them
    params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    singular = {p.name: _SINGULAR[p.name] for p in params if p.name in _SINGULAR}
    plural = {p.name: _PLURAL[p.name] for p in params if p.name in _PLURAL}
    if not singular and not plural:  # fn(response, ground_truth), whatever its names
        try:
            signature.bind("response", "ground_truth")
        except TypeError:
            raise VerifierSpecError(
                f"verifier {name!r} must accept (response, ground_truth) but its signature is {signature}"
            ) from None
        return LEGACY
    for fields in (singular, plural):
        twins = [p for p in fields if list(fields.values()).count(fields[p]) > 1]
        if twins:
            raise VerifierSpecError(f"verifier {name!r} names {twins[0]!r} and {twins[1]!r}, which are the same field")
    scope: Scope = "response"
    if "response" in plural.values():
        scope = "batch" if set(plural.values()) - {"response", "trajectory"} else "group"
        clash = next((p for p, f in singular.items() if scope == "batch" or f == "trajectory"), None)
        if clash:
            want = next(k for k, v in _PLURAL.items() if v == singular[clash])
            raise VerifierSpecError(
                f"verifier {name!r} scores several responses ({scope}) but takes {clash!r}; "
                f"name it {want!r}: one per response"
            )
    elif plural:
        raise VerifierSpecError(
            f"verifier {name!r} takes {next(iter(plural))!r} but scores one response; name its response "
            "parameter 'responses' to score several at once"
        )
    keywords = dict(singular | plural)
    if scope == "response":  # as positionally: fn(text, ground_truth), fn(response, answer) take what fn(r, g) gave
        leading = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        for p, field in zip(leading, ("response", "ground_truth")):
            if p.name not in keywords and field not in keywords.values():
                keywords[p.name] = field
    unnamed = [p for p in params if p.name not in keywords and p.default is p.empty]
    if unnamed:
        raise VerifierSpecError(
            f"verifier {name!r}: parameter {unnamed[0].name!r} is no field a verifier can be given "
            f"({_NAMES}; plural for several responses: responses, ground_truths, ...); its signature is {signature}"
        )
    if "response" not in keywords.values():
        raise VerifierSpecError(f"verifier {name!r} takes no response (name a parameter 'response'): {signature}")
    try:
        signature.bind(**{p: p for p in keywords})
    except TypeError as err:
        raise VerifierSpecError(f"verifier {name!r} cannot take {', '.join(keywords)} by name: {err}") from None
    return CallPlan(scope, (), tuple(keywords.items()))
