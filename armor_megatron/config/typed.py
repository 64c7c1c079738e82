"""Build typed dataclass configs from plain dicts, with errors that name the key.

Every problem becomes one ``ConfigError`` whose message starts with the dotted key, e.g.
``algorithm.alpha: 1.5 is out of range, must be in (0, 1]``. Field checks are declared next
to the field (``field(metadata={"check": ...})``) with the small check builders below.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from armor_megatron.errors import UserInputError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(UserInputError):
    """A configuration problem; ``str(err)`` is one line that starts with the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key


Check = Callable[[Any], str | None]
"""A field's value check: an error text, or None when the value is fine. Every check a schema field
uses carries ``check.describe``, the accepted values in words (``docs/config.md`` shows it)."""


def described(text: str, check: Check) -> Check:
    """``check`` with ``describe = text``: the accepted values, as the config reference shows them."""
    setattr(check, "describe", text)  # noqa: B010 (a function attribute: no declared field to assign)
    return check


REDACTED = "<redacted>"


def checked(
    default: Any = dataclasses.MISSING,
    *,
    check: Check | None = None,
    factory: Callable[[], Any] | None = None,
    help: str = "",
    secret: bool = False,
) -> Any:
    """A dataclass field with an optional value check (returns an error text or None) and a help text.

    A ``secret`` one is shown as ``<redacted>`` by :func:`to_dict` unless asked for secrets.
    """
    meta = {"check": check, "help": help, "secret": secret}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def in_range(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Check:
    """Check ``lo (<|<=) x (<|<=) hi``; the message shows the interval in math notation."""
    text = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{')' if hi_open else ']'}"

    def check(x: Any) -> str | None:
        if x is None:
            return None
        bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
        bad_hi = hi is not None and (x >= hi if hi_open else x > hi)
        return f"{x!r} is out of range, must be in {text}" if bad_lo or bad_hi else None

    return described(text, check)


def positive(x: Any) -> str | None:
    """A number > 0 (or unset)."""
    return None if x is None or x > 0 else f"{x!r} must be > 0"


described("> 0", positive)


def at_least(n: int) -> Check:
    """Check ``x >= n`` (or unset)."""
    return described(f">= {n}", lambda x: None if x is None or x >= n else f"{x!r} must be >= {n}")


def at_least_or_null(n: int) -> Check:
    """``at_least(n)`` whose refusal says that null is the other choice."""
    return described(f">= {n} or null", lambda x: None if x is None or x >= n else f"{x!r} must be >= {n} or null")


def registered(registry: Any) -> Check:
    """The value must name an entry of `registry` (an `armor_megatron.registry.Registry`).

    The description lists each entry with the config keys that supply its parameters, e.g.
    ``qae (qae_quantile, std_eps)``.
    """

    def check(name: Any) -> str | None:
        return None if name in registry else f"unknown {registry.kind} {name!r}; known: {', '.join(registry)}"

    def listed(name: str) -> str:
        keys = registry.entry(name, load=False).config_keys  # a lazily named entry stays unimported
        return f"{name} ({', '.join(keys.values())})" if keys else name

    return described(f"a registered {registry.kind}: {', '.join(map(listed, registry))}", check)


def non_empty(x: Any) -> str | None:
    """A value that is not empty (or unset)."""
    return None if x is None or x else "must not be empty"


described("not empty", non_empty)


def path_component(x: Any) -> str | None:
    """A value that names one directory entry: not empty, no path separator, not ``.`` or ``..``."""
    if not x:
        return "must not be empty"
    if "/" in x or "\\" in x or "\0" in x or x in (".", ".."):
        return f"must be a plain name (no '/', not '.' or '..'): {x!r} would place files outside their directory"
    return None


described("a plain name (no '/', not '.' or '..')", path_component)


# ---------------------------------------------------------------------------- building


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, resolved once per class.

    The schema's annotations are strings (``from __future__ import annotations``), and evaluating
    them was most of a config's load time. Callers must not mutate the returned dict.
    """
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``, recursively, type- and range-checked."""
    if not isinstance(data, dict):
        raise ConfigError(key, f"expected a mapping (section), got {_type_name(data)}")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in data:
        if name not in fields:
            raise ConfigError(_join(key, str(name)), "unknown key" + _suggest(str(name), fields))
    values = {}
    for name, f in fields.items():
        sub = _join(key, name)
        if name in data:
            value = _coerce(hints[name], data[name], sub)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ConfigError(sub, "required key is missing")
        check = f.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(sub, problem)
        values[name] = value
    return cls(**values)


def to_dict(obj: Any, *, secrets: bool = False) -> Any:
    """The plain-data form of a config (for printing and saving beside checkpoints).

    A set secret field (an API key) reads ``<redacted>`` and a password in a URL ``***`` unless
    ``secrets`` (writing a config another job runs).
    """
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            hide = f.metadata.get("secret") and value is not None and not secrets
            out[f.name] = REDACTED if hide else to_dict(value, secrets=secrets)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v, secrets=secrets) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, secrets=secrets) for k, v in obj.items()}
    if isinstance(obj, str) and not secrets:
        return mask_url_passwords(obj)
    return obj


_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^/\s@]*(@)")


def mask_url_passwords(text: str) -> str:
    """``https://user:secret@host/...`` -> ``https://user:***@host/...`` (every URL in ``text``)."""
    return _URL_PASSWORD.sub(r"\1***\2", text)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(err)
        if len(options) == 1:
            raise errors[0]
        raise ConfigError(key, f"{value!r} does not match any of {', '.join(_type_name_of(o) for o in options)}")
    if origin is typing.Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:  # YAML 1.1 reads off / on as booleans
            value = "on" if value else "off"
        if value not in args:
            raise ConfigError(
                key,
                f"{value!r} is not one of {', '.join(repr(a) for a in args)}"
                + _suggest(str(value), [str(a) for a in args]),
            )
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, {} if value is None else value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {_type_name(value)}")
        (item,) = args or (Any,)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {_type_name(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_type_name(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_type_name(value)} {value!r}")
        return value
    if tp is float:
        number = value
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(key, f"expected a number, got {_type_name(value)} {value!r}")
        if not math.isfinite(number):
            raise ConfigError(key, f"{value!r} is not a finite number")
        return float(number)
    if tp is str:
        if not isinstance(value, str):
            hint = (
                " (quote it in YAML: values like 24:00:00 read as numbers)" if isinstance(value, (int, float)) else ""
            )
            raise ConfigError(key, f"expected a string, got {_type_name(value)} {value!r}{hint}")
        return value
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _type_name_of(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))
