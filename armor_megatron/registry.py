"""Name -> definition registries for the pluggable parts, in the shape of verl's
``register_adv_est`` / ``register_policy_loss``: advantage estimators and policy losses
(`algo.advantages`, `algo.loss`), model families (`models.families`).

Each entry keeps the registered function (or class), the arguments its signature takes, and
free metadata (an estimator's ``kind``, a loss's config class). Adding one is one decorated
definition plus its test::

    @register_advantage_estimator("my_est")
    def my_advantages(rewards: torch.Tensor, temperature: float = 1.0) -> torch.Tensor: ...

A wrong name raises one line listing the known names; arguments the function does not take
raise one line listing those it does. The module imports nothing of the package, so every
subpackage can keep a registry.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    fn: Callable[..., Any]
    parameters: tuple[str, ...]  # every parameter name of ``fn``, in order
    meta: Mapping[str, Any] = field(default_factory=dict)


class Registry(Mapping[str, Callable[..., Any]]):
    """Registered functions of one kind (e.g. ``"advantage estimator"``); a read-only mapping
    name -> function, plus :meth:`register`, :meth:`entry` and :meth:`call`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, RegistryEntry] = {}

    def register(self, name: str, *aliases: str, replace: bool = False, **meta: Any) -> Callable:
        """Decorator registering ``fn`` under ``name`` (and ``aliases``); returns ``fn`` unchanged.
        A taken name raises unless ``replace=True``."""
        names = (name, *aliases)
        for n in names:
            if not isinstance(n, str) or not n or n != n.strip():
                raise ValueError(f"{self.kind} name {n!r} must be a non-empty string without surrounding spaces")
            if n in self._entries and not replace:
                raise ValueError(f"{self.kind} {n!r} is already registered (pass replace=True to replace it)")

        def decorator(fn: Callable) -> Callable:
            parameters = tuple(inspect.signature(fn).parameters)
            for n in names:
                self._entries[n] = RegistryEntry(n, fn, parameters, dict(meta))
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and plugins that register temporarily)."""
        self.entry(name)
        del self._entries[name]

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        close = difflib.get_close_matches(str(name), self._entries, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; known: {', '.join(self._entries)}") from None

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` for the function registered as ``name``, after checking that
        it takes those arguments (one-line ValueError naming the ones it takes otherwise)."""
        entry = self.entry(name)
        try:
            inspect.signature(entry.fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(
                f"{self.kind} {name!r} takes ({', '.join(entry.parameters)}): {exc}; "
                f"got {len(args)} positional and keywords ({', '.join(kwargs) or 'none'})"
            ) from None
        return entry.fn(*args, **kwargs)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name not in self._entries:
            raise KeyError(name)
        return self._entries[name].fn

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
