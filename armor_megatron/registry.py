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
the engines that define weight-sync modes and rollout engines) names each entry by where its
definition lives, ``"package.module:attribute"`` (:meth:`~Registry.register_lazy`), imported on
first use; a decorator in that module registering the same name fills the entry in. A registry
whose config keys configure something other than the function (a policy loss's hyper-parameter
dataclass) says which trait holds it (``configures=``), and :meth:`~Registry.configure` builds it.
The module imports nothing of the package, so every subpackage can keep a registry.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RegistryEntry:
    """One registered definition: its name, function, parameter names and metadata."""

    name: str
    fn: Callable[..., Any] | None  # None: named lazily, its definition not imported yet
    parameters: tuple[str, ...]  # every parameter name of ``fn``, in order
    meta: Mapping[str, Any] = field(default_factory=dict)  # the registry's traits (and free metadata)
    config_keys: Mapping[str, str] = field(default_factory=dict)  # parameter -> config key of its section
    configured: Callable[..., Any] | None = None  # what the config keys configure; None: ``fn``
    target: str | None = None  # "package.module:attribute" of a lazily named definition

    def required(self, parameter: str) -> bool:
        """``parameter`` has no default: the caller (or its config key) must give it."""
        configured = self.configured or self.fn
        assert configured is not None  # config keys are registered with a definition
        return inspect.signature(configured).parameters[parameter].default is inspect.Parameter.empty

    def config_kwargs(self, section: Any) -> dict[str, Any]:
        """``{parameter: section.<config key>}`` for every hyper-parameter the entry takes from the config.

        A dotted key (``kl_loss.coef``) reads a subsection's key.
        """
        return {param: config_value(section, key) for param, key in self.config_keys.items()}


def config_value(section: Any, key: str) -> Any:
    """``section.<key>``, following the dots of a dotted key (``kl_loss.coef``) through subsections."""
    value = section
    for part in key.split("."):
        value = getattr(value, part)
    return value


class Registry(Mapping[str, Callable[..., Any] | None]):
    """Registered functions (or classes) of one kind (e.g. ``"advantage estimator"``).

    A read-only mapping name -> function, plus :meth:`register`, :meth:`entry`, :meth:`call` and
    :meth:`call_configured`.

    ``traits``: the metadata every entry carries, with its default (e.g. ``{"critic": False}``);
    registering another keyword fails in one line. Without ``traits`` any metadata is kept.
    ``configures``: the trait holding what an entry's config keys configure (its parameters are
    the ones they name); None: the function itself.
    """

    def __init__(self, kind: str, traits: Mapping[str, Any] | None = None, *, configures: str | None = None) -> None:
        self.kind = kind
        self.traits = None if traits is None else dict(traits)
        self.configures = configures
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
        configured = meta.get(self.configures) if self.configures else None
        if self.configures and configured is None:
            raise ValueError(f"{self.kind} {name!r}: registered without {self.configures}=")

        def decorator(fn: Callable) -> Callable:
            parameters = tuple(inspect.signature(fn).parameters)
            takes = tuple(inspect.signature(configured).parameters) if configured else parameters
            missing = [p for p in keys if p not in takes]
            if missing:
                raise ValueError(
                    f"{self.kind} {name!r}: config_keys name {', '.join(missing)}, which it does not take "
                    f"({', '.join(takes)})"
                )
            for n in names:
                lazy = self._entries[n].target if n in self._entries else None
                if lazy is not None and lazy != f"{fn.__module__}:{fn.__qualname__}":
                    raise ValueError(
                        f"{self.kind} {n!r} is named {lazy!r}, but {fn.__module__}:{fn.__qualname__} registers it"
                    )
                self._entries[n] = RegistryEntry(n, fn, parameters, dict(meta), keys, configured, lazy)
            return fn

        return decorator

    def register_lazy(self, name: str, target: str) -> None:
        """Name ``name``'s definition by where it lives, ``"package.module:attribute"``, imported on first use.

        For a layer that must know the name before the definition's module is imported (that module
        sits above it). The module may register the name itself (with its traits and config keys);
        otherwise the attribute is the definition, with the registry's default traits.
        """
        self._check_name(name)
        module, _, attribute = target.partition(":")
        if not module or not attribute:
            raise ValueError(f"{self.kind} {name!r}: {target!r} is not 'package.module:attribute'")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = RegistryEntry(name, None, (), self._with_traits(name, {}), target=target)

    def _resolved(self, entry: RegistryEntry) -> RegistryEntry:
        """``entry``, its lazily named definition imported (the module may register it itself)."""
        if entry.fn is not None or entry.target is None:
            return entry
        module, _, attribute = entry.target.partition(":")
        definition = getattr(importlib.import_module(module), attribute)
        entry = self._entries[entry.name]
        if entry.fn is None:  # the module did not register it: the attribute is the definition
            parameters = tuple(inspect.signature(definition).parameters)
            entry = RegistryEntry(entry.name, definition, parameters, entry.meta, target=entry.target)
            self._entries[entry.name] = entry
        return entry

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

    def entry(self, name: str, *, load: bool = True) -> RegistryEntry:
        """The entry registered as ``name``; an unknown name raises one line listing the known ones.

        A lazily named definition is imported first unless ``load`` is False (then its entry says
        only its name, traits and ``target``).
        """
        try:
            return self._resolved(self._entries[name]) if load else self._entries[name]
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
        assert fn is not None  # every entry is registered or named lazily (then imported by entry())
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

    def configure(self, name: str, section: Any, **kwargs: Any) -> Any:
        """What ``name``'s config keys configure (``configures=``: e.g. a loss's hyper-parameter dataclass).

        Built from the config ``section``'s keys the entry declares, plus ``kwargs``.
        """
        entry = self.entry(name)
        if entry.configured is None:
            return self.call_configured(name, section, **kwargs)
        return entry.configured(**entry.config_kwargs(section), **kwargs)

    def __getitem__(self, name: str) -> Callable[..., Any] | None:
        if name not in self._entries:
            raise KeyError(name)
        return self._resolved(self._entries[name]).fn

    def __contains__(self, name: object) -> bool:  # without importing a lazily named definition
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
