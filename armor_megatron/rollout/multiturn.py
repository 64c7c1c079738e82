"""Multi-turn rollouts with tools: token ids in, token ids out, on any `RolloutEngine`.

A response is a sequence of segments: model turns (sampled by the engine, trained on) and
observations from an environment (tool results, user turns: never trained on). For each prompt,
one environment is built from its dataset row; then, turn by turn::

    ids = prompt ids
    repeat:
        turn   = engine.generate([ids])            # every live trajectory in one request
        ids   += turn.token_ids                    # loss mask 1, the engine's log-probs
        obs    = env.step(turn.text)               # a thread, at most tool_timeout_s
        if obs is None: done
        ids   += encode(obs)                       # loss mask 0, log-prob 0; tokenised once

Nothing is re-tokenised from text: each request carries the token ids so far (SGLang's
``input_ids``), and the observation's ids are appended as the tokenizer made them, so the
trainer's teacher-forced log-probs of the model's tokens line up with the engine's token for token.

The environment is the user's class (``rollout.environment.spec: module:Class``)::

    class Calculator:
        def __init__(self, row):              # the row: prompt, answer, index and its other columns
            ...
        def step(self, response: str) -> str | None:
            ...                               # the next observation's text, or None when done

Limits, each ending the trajectory with the reason in its last turn's ``truncated`` and finish
reason ``length`` (counted in ``rollout/env_truncated/<reason>``):

* ``max_turns``: model turns; an environment that wants a further turn is cut off;
* ``max_total_tokens``: prompt + response tokens; each turn asks the engine for at most what is
  left, and an observation after which no model token fits is not appended;
* ``tool_timeout_s``: seconds one ``step`` may take (it runs in a daemon thread, off the driver's
  critical path; a step that overruns is abandoned, as a thread cannot be killed: a tool that must
  be stopped should run its own process);
* the model's own budget, ``sampling.max_new_tokens``, counts the model's tokens over all turns
  (finish reason ``length``, no ``truncated`` mark: as for a single-turn response);
  ``max_turn_tokens`` caps one turn (a turn cut by it is still answered by the environment).

Every live trajectory of a turn goes to the engine together, one request per distinct token
budget (the turn cap for most), so the engine batches them, and the turn's order is fixed
(a seeded engine reproduces a run exactly); the environments' steps of a turn run side by side.

An environment that raises fails the step (`EnvironmentStepError`, its traceback chained): that is
a bug in the user's code, not a response to score.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from armor_megatron.errors import UserInputError
from armor_megatron.rewards.spec import VerifierSpecError, import_callable
from armor_megatron.rollout.engine import RolloutError, Sample, SamplingParams

TRUNCATIONS = ("max_turns", "max_total_tokens", "tool_timeout")

Generate = Callable[..., list[list[Sample]]]  # engine.generate(prompts_token_ids, n, sampling, timeout=...)


class Environment(Protocol):
    """What ``rollout.environment.spec`` names: built from a row, stepped with each model turn."""

    def step(self, response: str) -> str | None:
        """The observation after the model's turn ``response`` (its text), or None when the episode is done."""


class EnvironmentSpecError(UserInputError):
    """``rollout.environment.spec`` cannot be used (one line)."""


class EnvironmentStepError(RolloutError):
    """A user environment raised; names the row and the turn, the original error chained."""


@dataclasses.dataclass(frozen=True)
class EnvironmentSettings:
    """``rollout.environment``: the environment class and the limits of one trajectory (module docstring)."""

    spec: str
    max_turns: int = 4
    tool_timeout_s: float = 30.0
    max_total_tokens: int | None = None
    max_turn_tokens: int | None = None  # tokens one model turn may generate; None: what the budgets leave
    stop: tuple[str, ...] = ()  # stop strings of every model turn, besides the rollout's (e.g. "</call>")


def load_environment(spec: str) -> Callable[[Mapping[str, Any]], Environment]:
    """The class (or factory) ``module:Class``; one-line `EnvironmentSpecError` when it cannot be imported."""
    try:
        return import_callable(spec)
    except VerifierSpecError as err:
        raise EnvironmentSpecError(str(err).replace("verifier spec", "rollout.environment.spec", 1)) from None


@dataclasses.dataclass
class _Trajectory:
    prompt_index: int
    prompt: list[int]
    env: Environment
    row_label: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    model_text: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str = "stop"
    last_turn: str = "stop"  # the finish reason of the model's last turn
    weight_version: str = ""
    done: bool = False

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    def add(self, ids: Sequence[int], logprobs: Sequence[float], model: bool) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [int(model)] * len(ids)

    def end(self, finish_reason: str, truncated: str | None = None) -> None:
        self.done, self.finish_reason = True, finish_reason
        if truncated is not None and self.turns:  # no turn: the prompt alone filled max_total_tokens
            self.turns[-1]["truncated"] = truncated

    def sample(self) -> Sample:
        return Sample(
            prompt_index=self.prompt_index,
            token_ids=tuple(self.token_ids),
            text="".join(self.model_text),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            loss_mask=tuple(self.loss_mask),
            trajectory=tuple(self.turns),
        )


class MultiTurnRollout:
    """Runs the environment loop of the module docstring on any engine's ``generate``.

    ``encode(text) -> token ids`` tokenises an observation (no special tokens added: the
    environment writes any chat-template markers it needs into its text).
    """

    def __init__(
        self,
        settings: EnvironmentSettings,
        encode: Callable[[str], list[int]],
        environment: Callable[[Mapping[str, Any]], Environment] | None = None,
    ):
        if settings.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {settings.max_turns}")
        if settings.tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {settings.tool_timeout_s}")
        self.settings = settings
        self.encode = encode
        self.environment = environment if environment is not None else load_environment(settings.spec)

    def generate(
        self,
        generate: Generate,
        prompts_token_ids: Sequence[Sequence[int]],
        rows: Sequence[Mapping[str, Any]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """``n`` multi-turn samples per prompt (``rows[i]`` builds prompt i's environments), in prompt order."""
        if len(rows) != len(prompts_token_ids):
            raise ValueError(f"{len(prompts_token_ids)} prompts but {len(rows)} rows")
        trajectories = [
            _Trajectory(i, [int(t) for t in p], self._build(row), _label(row))
            for i, (p, row) in enumerate(zip(prompts_token_ids, rows))
            for _ in range(n)
        ]
        s = self.settings
        turn_sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys(sampling.stop + s.stop)))
        for turn in range(s.max_turns):
            live = [t for t in trajectories if not t.done]
            if not live:
                break
            stepping = []
            # one request per distinct budget (the turn cap for most): each turn's tokens are the engine's own
            budgets = {id(t): self._budget(t, sampling.max_new_tokens) for t in live}
            for budget in sorted(set(budgets.values()), reverse=True):
                asked = [t for t in live if budgets[id(t)] == budget]
                if budget < 1:  # the prompt alone fills max_total_tokens
                    for t in asked:
                        t.end("length", "max_total_tokens")
                    continue
                request = dataclasses.replace(turn_sampling, max_new_tokens=budget)
                groups = generate([t.prompt + t.token_ids for t in asked], 1, request, timeout=timeout)
                for t, group in zip(asked, groups):
                    out = group[0]
                    if out.logprobs is None:
                        raise RolloutError("multi-turn rollouts need the engine's log-probs (return_logprob)")
                    t.add(out.token_ids, out.logprobs, model=True)
                    t.weight_version = out.weight_version
                    t.model_text.append(out.text)
                    t.turns.append({"response": out.text, "observation": None, "truncated": None})
                    t.last_turn = out.finish_reason
                    if out.finish_reason == "abort":
                        t.end("abort")
                    elif out.finish_reason == "length" and self._out_of_tokens(t, sampling.max_new_tokens):
                        t.end("length", self._which_limit(t, sampling.max_new_tokens))
                    else:  # stopped, or cut by max_turn_tokens: the environment answers
                        stepping.append(t)
            for t, (finished, obs) in zip(stepping, self._step_all(stepping, turn)):
                if not finished:
                    t.end("length", "tool_timeout")
                elif obs is None:
                    t.end(t.last_turn)  # done: "length" when the turn the environment closed on was cut
                elif turn + 1 == s.max_turns:
                    t.end("length", "max_turns")  # the observation it still had is not appended
                elif self._out_of_tokens(t, sampling.max_new_tokens):
                    t.end("length", self._which_limit(t, sampling.max_new_tokens))
                else:
                    ids = [int(x) for x in self.encode(obs)]
                    if (
                        s.max_total_tokens is not None
                        and len(t.prompt) + len(t.token_ids) + len(ids) >= s.max_total_tokens
                    ):
                        t.end("length", "max_total_tokens")  # the observation and one more model token do not fit
                        continue
                    t.turns[-1]["observation"] = obs
                    t.add(ids, [0.0] * len(ids), model=False)
        groups_out: list[list[Sample]] = [[] for _ in prompts_token_ids]
        for t in trajectories:
            groups_out[t.prompt_index].append(t.sample())
        return groups_out

    def anchor_rollout(
        self,
        generate: Generate,
        prompts_token_ids: Sequence[Sequence[int]],
        ground_truths: Sequence[tuple[Any, ...]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
    ) -> list[list[Sample]]:
        """`AnchorSampler`'s rollout: the ground truths are ``(verifier, answer, fields, row)`` (`anchor_truths`)."""
        return self.generate(generate, prompts_token_ids, [truth[3] for truth in ground_truths], n, sampling, timeout)

    def _build(self, row: Mapping[str, Any]) -> Environment:
        try:
            env = self.environment(row)
        except Exception as err:  # the user's constructor: a bug to fix, named, its traceback chained
            raise EnvironmentStepError(
                f"rollout.environment.spec {self.settings.spec!r} raised {type(err).__name__}: {err} building the "
                f"environment of {_label(row)} (its keys: {', '.join(sorted(map(str, row)))})"
            ) from err
        if not callable(getattr(env, "step", None)):
            raise EnvironmentSpecError(
                f"rollout.environment.spec {self.settings.spec!r} built a {type(env).__name__} without a "
                "step(response) -> str | None method"
            )
        return env

    def _budget(self, t: _Trajectory, max_new_tokens: int) -> int:
        """The tokens ``t``'s next turn may generate: the model's and the total budget's rest, the turn cap."""
        left = max_new_tokens - t.model_tokens
        if self.settings.max_total_tokens is not None:
            left = min(left, self.settings.max_total_tokens - len(t.prompt) - len(t.token_ids))
        if self.settings.max_turn_tokens is not None:
            left = min(left, self.settings.max_turn_tokens)
        return left

    def _out_of_tokens(self, t: _Trajectory, max_new_tokens: int) -> bool:
        """No model token is left for another turn (the model's budget or the total's)."""
        total = self.settings.max_total_tokens
        return t.model_tokens >= max_new_tokens or (total is not None and len(t.prompt) + len(t.token_ids) >= total)

    def _which_limit(self, t: _Trajectory, max_new_tokens: int) -> str | None:
        """The flag of a trajectory out of tokens: None for the model's own budget (as single-turn)."""
        return None if t.model_tokens >= max_new_tokens else "max_total_tokens"

    def _step_all(self, trajectories: Sequence[_Trajectory], turn: int) -> list[tuple[bool, str | None]]:
        """``env.step`` of every trajectory at once, each in a daemon thread: (finished in time, observation)."""
        results: list[Any] = [None] * len(trajectories)
        errors: list[BaseException | None] = [None] * len(trajectories)

        def run(k: int, t: _Trajectory) -> None:
            try:
                results[k] = t.env.step(t.turns[-1]["response"])
            except BaseException as err:  # noqa: BLE001 - re-raised below in the driver's thread
                errors[k] = err

        threads = [
            threading.Thread(target=run, args=(k, t), name=f"environment-step-{k}", daemon=True)
            for k, t in enumerate(trajectories)
        ]
        for thread in threads:
            thread.start()
        out: list[tuple[bool, str | None]] = []
        # the deadline counts from the start of all steps: they run side by side
        deadline = time.monotonic() + self.settings.tool_timeout_s
        for k, (t, thread) in enumerate(zip(trajectories, threads)):
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                out.append((False, None))
                continue
            if errors[k] is not None:
                err = errors[k]
                raise EnvironmentStepError(
                    f"environment {self.settings.spec!r} raised on {t.row_label}, turn {turn + 1}: "
                    f"{type(err).__name__}: {err}"
                ) from err
            obs = results[k]
            if obs is not None and not isinstance(obs, str):
                raise EnvironmentStepError(
                    f"environment {self.settings.spec!r} returned a {type(obs).__name__} on {t.row_label}, "
                    f"turn {turn + 1}; step must return the observation's text or None"
                )
            out.append((True, obs))
        return out


def _label(row: Mapping[str, Any]) -> str:
    return f"row {row['index']}" if "index" in row else "a row"


def truncation_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per response (means): model ``turns``, ``env_tokens``, and the share cut by each limit (`TRUNCATIONS`)."""
    multi = [s for s in samples if s.trajectory is not None]
    if not multi:
        return {}
    cut = [s.trajectory[-1].get("truncated") for s in multi if s.trajectory]
    out = {
        "rollout/turns": sum(len(s.trajectory or ()) for s in multi) / len(multi),
        "rollout/env_tokens": sum(s.env_tokens for s in multi) / len(multi),
    }
    out.update({f"rollout/env_truncated/{reason}": cut.count(reason) / len(multi) for reason in TRUNCATIONS})
    return out
