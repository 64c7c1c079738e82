"""Name -> verifier registry, ``module:function`` loading, and result coercion.

A verifier is any callable ``(response: str, ground_truth) -> RewardResult``, or one naming the
row fields it wants, or scoring a group or batch of responses at once
(:mod:`armor_megatron.rewards.fields`). Registered and user verifiers may also return a
bool/number (the score) or a dict with a ``"score"`` key (other numeric entries become the
breakdown, an ``"extracted"`` string is kept); the :class:`LoadedVerifier` handed out by
:func:`get_verifier` / :func:`load_verifier` always returns :class:`RewardResult` objects.
"""

from __future__ import annotations

import difflib
import functools
import numbers
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from armor_megatron.errors import DatasetError, UserInputError
from armor_megatron.rewards.fields import CallPlan, call_plan
from armor_megatron.rewards.result import RewardResult
from armor_megatron.rewards.spec import VerifierSpecError, import_callable
from armor_megatron.rewards.user_calls import (
    VerifierFailed,
    VerifierTimeouts,
    call_user_verifier,
    probe_user_verifier,
    user_verifier_timeout,
)

_REGISTRY: dict[str, LoadedVerifier] = {}
_GROUND_TRUTH_CHECKS: dict[str, Callable[[Any], Any]] = {}


def register_verifier(
    name: str, *, replace: bool = False, check_ground_truth: Callable[[Any], Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering verifier ``fn`` under ``name``; returns ``fn`` unchanged.

    ``fn`` takes ``(response, ground_truth)`` or names the fields it wants
    (:mod:`armor_megatron.rewards.fields`); it runs in this process, on the scoring threads.

    Registering a taken name raises unless ``replace=True`` (e.g. to swap in a ``math``
    verifier built with another timeout). ``check_ground_truth(ground_truth)``, if given,
    raises ValueError/TypeError for a ground truth the verifier cannot score; datasets run it
    on every row when they load (:func:`check_ground_truth`), so a bad row stops a run at
    start-up, not at the step that first samples it.
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise VerifierSpecError(f"verifier name {name!r} must be a non-empty string without ':' or surrounding spaces")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and not replace:
            raise VerifierSpecError(f"verifier {name!r} is already registered (pass replace=True to replace it)")
        _REGISTRY[name] = LoadedVerifier(name, fn, call_plan(fn, name))
        _GROUND_TRUTH_CHECKS.pop(name, None)
        if check_ground_truth is not None:
            _GROUND_TRUTH_CHECKS[name] = check_ground_truth
        return fn

    return decorator


class _ScorableRow(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def verifier(self) -> str | None: ...
    @property
    def answer(self) -> Any: ...


class _Scorable(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def rows(self) -> Sequence[_ScorableRow]: ...


_D = TypeVar("_D", bound=_Scorable)


def scorable(dataset: _D, default_verifier: str, allowed: Collection[str] = ()) -> _D:
    """``dataset``, once every row's verifier is allowed and has accepted its ground truth.

    ``dataset`` (``.path`` and ``.rows`` with ``index``, ``verifier``, ``answer``: a
    :class:`~armor_megatron.data.prompts.PromptDataset`), once every row's own verifier passed
    :func:`check_row_verifier` (a registered name, ``default_verifier`` or one of ``allowed``)
    and every row's verifier (its own, else ``default_verifier``) has accepted its ground truth:
    a row that names another function, or that no verifier can score, stops a run at start-up,
    in one line naming the file and row, not at the step that first samples it.
    """
    for row in dataset.rows:
        try:
            if row.verifier is not None:
                check_row_verifier(row.verifier, default_verifier, allowed)
            check_ground_truth(row.verifier or default_verifier, row.answer)
        except ValueError as e:
            raise DatasetError(f"{dataset.path}: row {row.index}: {e}") from None
    return dataset


def check_row_verifier(name: Any, default_verifier: str, allowed: Collection[str] = ()) -> None:
    """Raise VerifierSpecError (one line) unless a dataset row may name verifier ``name``.

    A row's ``type`` comes with the data, so it may name a registered verifier, the config's
    own ``default_verifier`` (``reward.verifier``) or a ``module:function`` the config lists in
    ``allowed`` (``reward.verifiers``), nothing else: data cannot make the trainer call an
    arbitrary importable function (``builtins:exec`` would run the response as code).
    """
    if not isinstance(name, str):
        raise VerifierSpecError(f"verifier {name!r} is a {type(name).__name__}, not a verifier name")
    if name == default_verifier or name in allowed or (":" not in name and name in _REGISTRY):
        return
    if ":" not in name:
        get_verifier(name)  # raises: an unknown name, with a suggestion
    raise VerifierSpecError(
        f"verifier {name!r} is not allowed in a row's type: it may name a registered verifier "
        f"({', '.join(registered_verifiers())}), reward.verifier, or a module:function listed in reward.verifiers"
    )


def check_ground_truth(verifier: str, ground_truth: Any) -> None:
    """Raise ValueError (one line) if ``verifier`` declares ``ground_truth`` unscorable.

    Verifiers that declare no check (user verifiers) accept anything.
    """
    check = _GROUND_TRUTH_CHECKS.get(verifier)
    if check is None:
        return
    try:
        check(ground_truth)
    except (TypeError, ValueError) as e:
        raise UserInputError(
            f"ground truth {ground_truth!r:.80} cannot be scored by verifier {verifier!r}: {e}"
        ) from None


NO_ANSWER = "I cannot solve this."  # a response stating no answer: a verifier scores it too (0, not None)


def stating_response(ground_truth: Any) -> str:
    r"""A response stating ``ground_truth`` in each usual final-answer form, for probes of a verifier.

    ``The answer is \boxed{X}.``, GSM8K's ``#### X`` and DAPO's ``Answer: X`` lines, so verl's
    gsm8k and math_dapo scorers read it as they read a model's answer; empty for a ground truth
    that is neither a string nor a number (nothing to state).
    """
    if not isinstance(ground_truth, (str, numbers.Real)):
        return ""
    return f"The answer is \\boxed{{{ground_truth}}}.\n#### {ground_truth}\nAnswer: {ground_truth}"


def probe_verifier(
    spec: str, ground_truth: Any, response: str | None = None, fields: Mapping[str, Any] | None = None
) -> float | None:
    r"""Check a user verifier on one response to a row whose ground truth is ``ground_truth``; its score.

    Call a user verifier (``module:function``, a name registered outside this package, or the
    remote judge) once, on ``response`` (default: `stating_response`, the ground truth as a
    ``\boxed{}``, ``####`` and ``Answer:`` line; :data:`NO_ANSWER` for the responses early in a
    run, which state none) with the row's ``fields``
    (:data:`~armor_megatron.rewards.fields.ROW_FIELDS`; a group or batch verifier gets
    a group of this one response), and raise VerifierSpecError in one line if it raises, outlasts
    ``reward.timeout_s``, or returns what :func:`as_reward_result` refuses (a string, None, a dict
    without ``score``, a non-finite score, a list of another length than its responses). Built-in
    verifiers are not called (None is returned): they always return a RewardResult, and the math
    one starts worker processes.
    """
    verifier = load_verifier(spec)
    if not verifier.probed:
        return None
    if response is None:
        response = stating_response(ground_truth)
        on = f"on a response stating the ground truth {ground_truth!r:.60}"
    elif response == NO_ANSWER:
        on = f"on the response {response!r}, which states no answer (a verifier returns a reward, e.g. 0, for every response)"
    else:
        on = f"on the response {response!r:.60} (ground truth {ground_truth!r:.40})"
    try:
        return verifier.score([response], [ground_truth], [fields or {}], probe=on)[0].score
    except VerifierTimeouts as err:
        raise VerifierSpecError(str(err)) from None
    except VerifierFailed as err:
        raise VerifierSpecError(f"verifier {spec!r} raised {err.kind} {on}: {err.detail}") from None
    except VerifierResultError as err:
        line = str(err).splitlines()[0]
        raise VerifierSpecError(f"{line}, {on}") from None
    except UserInputError as err:
        raise VerifierSpecError(f"{str(err).splitlines()[0]}, {on}") from None
    except Exception as err:
        detail = str(err).splitlines()[0] if str(err) else ""
        raise VerifierSpecError(f"verifier {spec!r} raised {type(err).__name__} {on}: {detail}") from None


def _in_thread(fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], on: str) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread, waiting at most ``reward.timeout_s`` (VerifierTimeouts after)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except Exception as err:  # noqa: BLE001 - re-raised in the caller's thread
            outcome.append((False, err))

    thread = threading.Thread(target=run, name=f"probe-{name}", daemon=True)
    thread.start()
    thread.join(user_verifier_timeout())
    if not outcome:
        raise VerifierTimeouts(
            f"verifier {name!r} did not return within reward.timeout_s={user_verifier_timeout():g}s {on}"
        )
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class LoadedVerifier:
    """A verifier ready to score: its name, how it is called (:class:`~armor_megatron.rewards.fields.CallPlan`), and where.

    ``verifier(response, ground_truth, fields)`` scores one response; :meth:`score` makes one call
    on one response, one prompt's group or a batch, as the verifier's scope asks. A user verifier
    (``module:function``) runs in a reward worker process under ``reward.timeout_s``; a registered
    one in this process.
    """

    def __init__(self, name: str, fn: Callable[..., Any], plan: CallPlan, user: bool = False) -> None:
        self.name, self.fn, self.plan, self.user = name, fn, plan, user
        module = getattr(fn, "__module__", None) or ""
        self.probed = user or not module.startswith(f"{__package__}.") or bool(getattr(fn, "probe_at_start", False))

    def __call__(self, response: str, ground_truth: Any, fields: Mapping[str, Any] | None = None) -> RewardResult:
        """The verdict on one response (a group or batch verifier scores it as a group of one)."""
        return self.score([response], [ground_truth], [fields or {}])[0]

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        fields: Sequence[Mapping[str, Any]],
        probe: str | None = None,
    ) -> list[RewardResult]:
        """One call: on one response, on one prompt's responses (a group verifier), or on a batch.

        ``fields[i]``: response ``i``'s row fields. With ``probe`` (which response it is, for
        messages), a timeout raises instead of scoring 0. A group or batch verifier must return
        one score per response, in order; anything else raises VerifierResultError naming it.
        """
        n = len(responses)
        if self.plan.scope == "response" and n != 1:
            raise ValueError(f"verifier {self.name!r} scores one response per call, got {n}")
        args, kwargs = self.plan.arguments(self.plan.values(responses, ground_truths, fields))
        if self.user and probe is not None:
            value = probe_user_verifier(self.name, args, kwargs, probe)
        elif self.user:
            value = call_user_verifier(self.name, args, kwargs)
        elif probe is not None:
            value = _in_thread(self.fn, self.name, args, kwargs, probe)
        else:
            value = self.fn(*args, **kwargs)
        if self.plan.scope == "response":
            return [as_reward_result(value, self.name)]
        if isinstance(value, RewardResult):  # the call timed out or its worker died: every response scores 0
            return [value] * n
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") or len(value) != n:
            got = (
                f"{len(value)} scores"
                if hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
                else f"{type(value).__name__} {value!r:.40}"
            )
            raise VerifierResultError(
                f"verifier {self.name!r} returned {got} for {n} responses; a {self.plan.scope} verifier returns "
                "one score per response, in order"
            )
        return [as_reward_result(v, self.name) for v in value]


def unregister_verifier(name: str) -> None:
    """Remove the verifier registered as ``name`` (a test or plugin undoing its :func:`register_verifier`).

    An unknown name raises VerifierSpecError.
    """
    if name not in _REGISTRY:
        raise VerifierSpecError(f"verifier {name!r} is not registered, so it cannot be unregistered")
    del _REGISTRY[name]
    _GROUND_TRUTH_CHECKS.pop(name, None)


def registered_verifiers() -> list[str]:
    """The names of the registered verifiers, sorted."""
    return sorted(_REGISTRY)


def get_verifier(name: str) -> LoadedVerifier:
    """The registered verifier called ``name`` (e.g. ``"math"``, ``"multiple_choice"``, ``"format"``)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        pass
    if name == "remote":
        raise VerifierSpecError("verifier 'remote' is the judge at reward.remote.url, which is not set")
    close = difflib.get_close_matches(str(name), _REGISTRY, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise VerifierSpecError(
        f"unknown verifier {name!r}{hint} (registered: {', '.join(registered_verifiers())}; "
        "a user verifier is given as 'package.module:function')"
    )


def load_verifier(spec: str) -> LoadedVerifier:
    """A registered name (``"math"``) or a user verifier ``"package.module:function"``.

    Raises VerifierSpecError with one line naming the spec and the problem: unknown name,
    module not importable, no such function, not callable, or a parameter it names that no
    field supplies (:func:`~armor_megatron.rewards.fields.call_plan`).
    """
    if isinstance(spec, str) and ":" in spec:
        return _load_user_verifier(spec)
    return get_verifier(spec)


@functools.cache
def _load_user_verifier(spec: str) -> LoadedVerifier:
    fn = import_callable(spec)
    return LoadedVerifier(spec, fn, call_plan(fn, spec), user=True)


class VerifierResultError(UserInputError, TypeError):
    """A verifier returned what is not a reward (a string, None, a dict without ``score``, NaN)."""


def as_reward_result(value: Any, name: str) -> RewardResult:
    """Turn what a verifier returned into a RewardResult (see module docstring).

    Anything else raises VerifierResultError naming the verifier ``name`` and the value.
    """
    if isinstance(value, RewardResult):
        return value
    try:
        if isinstance(value, numbers.Real):
            return RewardResult(float(value))
        if isinstance(value, Mapping) and "score" in value:
            breakdown = {
                str(k): float(v)
                for k, v in value.items()
                if k not in ("score", "extracted") and isinstance(v, numbers.Real)
            }
            extracted = value.get("extracted")
            return RewardResult(value["score"], breakdown, extracted if isinstance(extracted, str) else None)
    except (TypeError, ValueError) as err:
        raise VerifierResultError(f"verifier {name!r} returned {value!r:.60}: {err}") from None
    raise VerifierResultError(
        f"verifier {name!r} returned {type(value).__name__} {value!r:.40}; expected RewardResult, a number, "
        "or a dict with a 'score' key"
    )
