"""Resolve ``"package.module:function"`` strings to callables, with one-line errors."""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

from armor_megatron.errors import UserInputError

_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class VerifierSpecError(UserInputError):
    """A verifier name or ``module:function`` spec that cannot be used."""


def import_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:attr`` (``attr`` may be dotted, e.g. ``mod:Class.method``) and return it.

    Raises VerifierSpecError naming the spec and the problem: malformed spec, module not
    importable, attribute missing, or not callable.
    """
    if not isinstance(spec, str) or not _SPEC.fullmatch(spec):
        raise VerifierSpecError(f"verifier spec {spec!r} is not of the form 'package.module:function'")
    module_name, attr_path = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = "; modules are found on sys.path and in reward.python_path (default: the config file's directory)"
        raise VerifierSpecError(
            f"verifier spec {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}{hint})"
        ) from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise VerifierSpecError(f"verifier spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise VerifierSpecError(f"verifier spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not a callable")
    fn: Callable[..., Any] = obj
    return fn


_SEARCH_PATHS: list[str] = []  # what add_search_paths added, for worker processes to add too


def search_paths() -> tuple[str, ...]:
    """The directories :func:`add_search_paths` added to ``sys.path``, in order."""
    return tuple(_SEARCH_PATHS)


def add_search_paths(directories: Iterable[str]) -> list[str]:
    """Add directories to ``sys.path`` for user verifier modules.

    Append each directory (made absolute) to ``sys.path`` once, after the installed packages,
    so ``module:function`` specs import user modules from it without shadowing an installed
    module; returns the absolute paths.
    """
    added = []
    for directory in directories:
        path = os.path.abspath(directory)
        if path not in sys.path:
            sys.path.append(path)
        if path not in _SEARCH_PATHS:
            _SEARCH_PATHS.append(path)
        added.append(path)
    return added
