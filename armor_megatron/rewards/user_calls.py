"""User verifiers (``module:function``) run in killable worker processes, under a timeout.

A user verifier is code the trainer does not control: it may hang (a sandbox that never returns,
an HTTP judge without a timeout), loop, or eat memory. So every call runs in a worker of
:mod:`armor_megatron.rewards.isolated`'s pool, the one the math verifier uses (memory cap
``reward.memory_limit_mb``, reply size cap, SIGTERM-proof, killable), and waits at most
``timeout_s`` (``reward.timeout_s``):

* a call that runs longer is stopped (its worker killed and replaced) and scores 0, with
  ``timed_out = 1`` in its breakdown (the trainer logs their number as ``reward/timeouts``); so
  does a worker that dies (the OS killed it), with ``worker_died = 1``;
* ``max_consecutive_timeouts`` such failures in a row (no call of that verifier returning in
  between) mean the verifier hangs rather than one response being hard:
  :class:`VerifierTimeouts` fails the step in one line;
* what the verifier raises comes back as :class:`VerifierFailed`, one line with its type and
  message;
* :func:`~armor_megatron.rewards.isolated.interrupt_calls` (the trainer's preemption handler)
  stops the calls in flight at once.

The verifier's arguments and result cross a pipe (pickle): the response string, the row's ground
truth and the other row fields it names, as the dataset holds them, and what the verifier returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from armor_megatron.errors import UserInputError
from armor_megatron.rewards.isolated import (
    IsolatedCallError,
    IsolatedTimeout,
    UnpicklableArguments,
    WorkerDied,
    run_isolated,
)
from armor_megatron.rewards.result import RewardResult

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_CONSECUTIVE_TIMEOUTS = 8


class VerifierTimeouts(UserInputError):
    """A user verifier timed out (or killed its worker) on too many responses in a row."""


class UnpicklableRowFields(UserInputError):
    """What a user verifier is given (its response, ground truth, row fields) does not pickle."""


class VerifierFailed(UserInputError):
    """A user verifier raised an exception on a response: ``kind`` (its type's name) and ``detail`` (its message)."""

    def __init__(self, spec: str, kind: str, detail: str):
        super().__init__(f"verifier {spec!r} raised {kind}: {detail}" if detail else f"verifier {spec!r} raised {kind}")
        self.kind, self.detail = kind, detail


class _Settings:
    timeout_s = DEFAULT_TIMEOUT_S
    max_consecutive_timeouts = DEFAULT_MAX_CONSECUTIVE_TIMEOUTS


_lock = threading.Lock()
_in_a_row: dict[str, int] = {}  # per verifier: failed calls since its last returned one


def configure_user_verifiers(timeout_s: float | None = None, max_consecutive_timeouts: int | None = None) -> None:
    """Set the timeout of one user-verifier call and how many failures in a row fail the step."""
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        _Settings.timeout_s = float(timeout_s)
    if max_consecutive_timeouts is not None:
        if max_consecutive_timeouts < 1:
            raise ValueError(f"max_consecutive_timeouts must be >= 1, got {max_consecutive_timeouts}")
        _Settings.max_consecutive_timeouts = int(max_consecutive_timeouts)


def user_verifier_timeout() -> float:
    """Seconds one user-verifier call may take (``reward.timeout_s``)."""
    return _Settings.timeout_s


def call_user_verifier(spec: str, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> Any:
    """``spec(*args, **kwargs)`` in a worker process: what it returned, or a 0 score.

    The arguments are the response, ground truth and row fields the verifier names
    (:mod:`armor_megatron.rewards.fields`); they must pickle, as rows read from JSON or Parquet do.
    Returns what the verifier returned (the caller coerces it), or ``RewardResult(0)`` with
    ``timed_out``/``worker_died`` = 1 when the call timed out or its worker died; raises
    :class:`VerifierTimeouts` when that was the ``max_consecutive_timeouts``-th in a row,
    :class:`VerifierFailed` when the verifier raised, and
    :class:`~armor_megatron.rewards.isolated.CallsInterrupted` when calls were stopped.
    """
    timeout_s = _Settings.timeout_s
    try:
        value = run_isolated(spec, *args, timeout_s=timeout_s, kwargs=kwargs)
    except IsolatedTimeout:
        return _failed(spec, "timed_out", f"did not return within reward.timeout_s={timeout_s:g}s")
    except WorkerDied as err:
        return _failed(spec, "worker_died", f"killed its worker process ({err})")
    except UnpicklableArguments as err:
        raise UnpicklableRowFields(
            f"verifier {spec!r}: its arguments do not pickle ({err}), so they cannot reach its worker process; "
            "row fields must be plain data, as JSON or Parquet hold them"
        ) from None
    except IsolatedCallError as err:  # "Type: message" from the worker
        kind, _, detail = (str(err).splitlines() or ["Exception"])[0].partition(": ")
        raise VerifierFailed(spec, kind, detail) from None
    with _lock:
        _in_a_row[spec] = 0
    return value


def probe_user_verifier(spec: str, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, on: str) -> Any:
    """:func:`call_user_verifier` for a start-up check: a timeout or a dead worker raises, in one line.

    ``on`` says which response it was (e.g. ``on a response stating the ground truth '34'``).
    """
    value = call_user_verifier(spec, args, kwargs)
    if isinstance(value, RewardResult) and (value.breakdown.get("timed_out") or value.breakdown.get("worker_died")):
        what = "did not return within" if value.breakdown.get("timed_out") else "killed its worker within"
        raise VerifierTimeouts(f"verifier {spec!r} {what} reward.timeout_s={_Settings.timeout_s:g}s {on}")
    return value


def _failed(spec: str, kind: str, what: str) -> RewardResult:
    with _lock:
        n = _in_a_row[spec] = _in_a_row.get(spec, 0) + 1
    limit = _Settings.max_consecutive_timeouts
    if n >= limit:
        with _lock:
            _in_a_row[spec] = 0  # the next step starts counting afresh
        raise VerifierTimeouts(
            f"verifier {spec!r} {what} on {n} responses in a row (reward.max_consecutive_timeouts={limit}): "
            "it hangs or crashes, not one hard response; fix it or raise reward.timeout_s"
        )
    logger.warning("verifier %r %s (%d in a row); the response scores 0", spec, what, n)
    return RewardResult(0.0, {kind: 1.0})
