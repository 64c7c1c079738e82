"""``rollout.environment`` tried before a run: built from the first training rows and stepped once.

The user's class is built from each row as the rollout builds it (`data.prompts.row_mapping`:
the row's other columns, ``prompt``, ``answer``, ``index``) and stepped once with a response stating
the row's ground truth (`rewards.registry.stating_response`), in a daemon thread waiting at most
``rollout.environment.tool_timeout_s``. A constructor or step that raises is a ConfigError of
``rollout.environment.spec`` naming the class, the dataset row and the error (and, for the
constructor, the keys it was given: a ``KeyError`` names a column the rows lack); a step that
(or constructor) that outlasts the timeout, or one that returns neither a string nor None, is a
warning line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError
from armor_megatron.data.prompts import PromptRow, row_mapping

KEY = "rollout.environment.spec"


def probe_environment(cfg: RunConfig, rows: Sequence[PromptRow]) -> list[str]:
    """Build ``cfg``'s environment from each of ``rows`` (of ``data.train_path``) and step it once; the warnings."""
    from armor_megatron.rewards.registry import NO_ANSWER, stating_response
    from armor_megatron.rewards.spec import import_callable

    env = cfg.rollout.environment
    if env.spec is None:
        return []
    factory = import_callable(env.spec)  # the config's own check imported it already
    warnings = []
    for row in rows:
        where = f"{cfg.data.train_path} row {row.index}"
        mapping = row_mapping(row)
        ok, built = _call(factory, (mapping,), env.tool_timeout_s)
        if not ok:
            keys = ", ".join(sorted(map(str, mapping)))
            raise ConfigError(KEY, f"{env.spec}: building it from {where} {_failure(built)} (its keys: {keys})")
        if built is _TIMED_OUT:
            warnings.append(f"{KEY}: {env.spec}: building it from {where} {_slow(env.tool_timeout_s)}")
            continue
        step = getattr(built, "step", None)
        if not callable(step):
            raise ConfigError(KEY, f"{env.spec} built a {type(built).__name__} without a step(response) method")
        response = stating_response(row.answer) or NO_ANSWER
        ok, observation = _call(step, (response,), env.tool_timeout_s)
        if not ok:
            raise ConfigError(KEY, f"{env.spec}: step() on {where} {_failure(observation)} (response {response!r:.60})")
        if observation is _TIMED_OUT:
            warnings.append(f"{KEY}: {env.spec}: step() on {where} {_slow(env.tool_timeout_s)}")
        elif observation is not None and not isinstance(observation, str):
            warnings.append(
                f"{KEY}: {env.spec}: step() on {where} returned {type(observation).__name__} {observation!r:.40}, "
                "not the observation's text (str) or None (done)"
            )
    return warnings


_TIMED_OUT = object()


def _call(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> tuple[bool, Any]:
    """``fn(*args)`` in a daemon thread: (True, its value or `_TIMED_OUT` after ``timeout`` s) or (False, its exception)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except Exception as err:  # noqa: BLE001 - reported in the caller's thread
            outcome.append((False, err))

    thread = threading.Thread(target=run, name="environment-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else (True, _TIMED_OUT)


def _slow(timeout: float) -> str:
    return f"did not return within rollout.environment.tool_timeout_s={timeout:g}s (a step that slow ends its response)"


def _failure(err: BaseException) -> str:
    """``raised KeyError: 'expression'``: the error's type and first line."""
    text = str(err).splitlines()[0] if str(err) else ""
    return f"raised {type(err).__name__}" + (f": {text}" if text else "")
