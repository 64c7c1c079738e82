"""Name -> definition registries for the pluggable parts.

Name -> definition registries, one per kind of pluggable part, in the shape of verl's
``register_adv_est`` / ``register_policy_loss``: advantage estimators, policy losses and
reference reset schedules (`algo.advantages`, `algo.loss`, `algo.reset`), weight-sync modes
(`rollout.sglang.weight_sync`), model families (`models.families`).

Each entry keeps the function (or class), the arguments its signature takes, what callers need
to know about it (its *traits*, declared with defaults by the registry: an estimator's
``critic``, a reset schedule's ``needs_eval``) and which config keys supply its
hyper-parameters (``config_keys``: parameter -> key of the config section). Adding a variant is
one decorated definition, its config keys and its test::

    @register_advantage_estimator("my_est", config_keys={"eps": "std_eps"})
    def my_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor: ...

The config accepts every registered name (``config.typed.registered``) and the trainer builds
the variant with ``registry.call_configured(name, section, ...)``. A wrong name raises one line
listing the known names; arguments the function does not take raise one line listing those it
does; an undeclared trait raises one line listing the declared ones.

A layer that must know the names before the code defining them is imported (the config, below
the engines that define weight-sync modes) declares them (:meth:`~Registry.declare`); the
definition registered later under a declared name fills the entry in. The module imports nothing
of the package, so every subpackage can keep a registry.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RegistryEntry:
    """One registered definition: its name, function, parameter names and metadata."""

    name: str
    fn: Callable[..., Any] | None  # None: declared, its definition not registered yet
    parameters: tuple[str, ...]  # every parameter name of ``fn``, in order
    meta: Mapping[str, Any] = field(default_factory=dict)  # the registry's traits (and free metadata)
    config_keys: Mapping[str, str] = field(default_factory=dict)  # parameter -> config key of its section

    def required(self, parameter: str) -> bool:
        """``parameter`` has no default: the caller (or its config key) must give it."""
        assert self.fn is not None  # config keys are registered with a definition
        return inspect.signature(self.fn).parameters[parameter].default is inspect.Parameter.empty

    def config_kwargs(self, section: Any) -> dict[str, Any]:
        """``{parameter: section.<config key>}`` for every hyper-parameter the entry takes from the config."""
        return {param: getattr(section, key) for param, key in self.config_keys.items()}


class Registry(Mapping[str, Callable[..., Any] | None]):
    """Registered functions (or classes) of one kind (e.g. ``"advantage estimator"``).

    A read-only mapping name -> function, plus :meth:`register`, :meth:`entry`, :meth:`call` and
    :meth:`call_configured`.

    ``traits``: the metadata every entry carries, with its default (e.g. ``{"critic": False}``);
    registering another keyword fails in one line. Without ``traits`` any metadata is kept.
    """

    def __init__(self, kind: str, traits: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self.traits = None if traits is None else dict(traits)
        self._entries: dict[str, RegistryEntry] = {}

    def register(
        self,
        name: str,
        *aliases: str,
        replace: bool = False,
        config_keys: Mapping[str, str] | None = None,
        **meta: Any,
    ) -> Callable:
        """Decorator registering ``fn`` under ``name`` (and ``aliases``); returns ``fn`` unchanged.

        ``config_keys`` maps parameters of ``fn`` to the config keys that supply them; ``meta`` sets
        traits. A taken name raises unless ``replace=True``.
        """
        names = (name, *aliases)
        for n in names:
            self._check_name(n)
            if n in self._entries and self._entries[n].fn is not None and not replace:
                raise ValueError(f"{self.kind} {n!r} is already registered (pass replace=True to replace it)")
        meta = self._with_traits(name, meta)
        keys = dict(config_keys or {})

        def decorator(fn: Callable) -> Callable:
            parameters = tuple(inspect.signature(fn).parameters)
            missing = [p for p in keys if p not in parameters]
            if missing:
                raise ValueError(
                    f"{self.kind} {name!r}: config_keys name {', '.join(missing)}, which it does not take "
                    f"({', '.join(parameters)})"
                )
            for n in names:
                self._entries[n] = RegistryEntry(n, fn, parameters, dict(meta), keys)
            return fn

        return decorator

    def declare(self, *names: str) -> None:
        """Make ``names`` known before their definitions are registered.

        Make ``names`` known before their definitions are registered (their module sits above
        the layer that reads the names); :meth:`call` refuses a name still without one.
        """
        for n in names:
            self._check_name(n)
            if n in self._entries:
                raise ValueError(f"{self.kind} {n!r} is already registered")
            self._entries[n] = RegistryEntry(n, None, (), self._with_traits(n, {}))

    def _check_name(self, n: Any) -> None:
        if not isinstance(n, str) or not n or n != n.strip():
            raise ValueError(f"{self.kind} name {n!r} must be a non-empty string without surrounding spaces")

    def _with_traits(self, name: str, meta: dict[str, Any]) -> dict[str, Any]:
        if self.traits is None:
            return meta
        unknown = sorted(set(meta) - set(self.traits))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown trait {', '.join(unknown)}; declared: {', '.join(self.traits) or 'none'}"
            )
        return {**self.traits, **meta}

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and plugins that register temporarily)."""
        self.entry(name)
        del self._entries[name]

    def entry(self, name: str) -> RegistryEntry:
        """The entry registered as ``name``; an unknown name raises one line listing the known ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        close = difflib.get_close_matches(str(name), self._entries, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; known: {', '.join(self._entries)}") from None

    def definition(self, name: str) -> Callable[..., Any]:
        """The function (or class) registered as ``name``.

        One line for an unknown name or one only declared so far.
        """
        fn = self.entry(name).fn
        if fn is None:
            raise ValueError(f"{self.kind} {name!r} is declared but its definition is not registered")
        return fn

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the function registered as ``name``, checking it takes the given arguments.

        ``fn(*args, **kwargs)`` for the function registered as ``name``, after checking that
        it takes those arguments (one-line ValueError naming the ones it takes otherwise).
        """
        entry = self.entry(name)
        fn = self.definition(name)
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(
                f"{self.kind} {name!r} takes ({', '.join(entry.parameters)}): {exc}; "
                f"got {len(args)} positional and keywords ({', '.join(kwargs) or 'none'})"
            ) from None
        return fn(*args, **kwargs)

    def call_configured(self, name: str, section: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``name`` with the hyper-parameters it takes from the config ``section``.

        :meth:`call` with the hyper-parameters ``name`` takes from the config ``section`` (its
        ``config_keys``) added to ``kwargs``.
        """
        return self.call(name, *args, **self.entry(name).config_kwargs(section), **kwargs)

    def __getitem__(self, name: str) -> Callable[..., Any] | None:  # None: declared, not yet defined
        if name not in self._entries:
            raise KeyError(name)
        return self._entries[name].fn

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
