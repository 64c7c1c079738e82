"""The reference of every config key, read from the schema: ``docs/config.md`` and ``armor-train --explain KEY``.

Each field of ``config.schema`` carries its help text and its check; each check says in words
what it accepts (``check.describe``), and each section class has a docstring. From those this
module builds one :class:`KeyDoc` per key (type, default, accepted values, meaning), renders the
Markdown file (``python tools/config_docs.py`` writes it; a test fails when it is stale) and
explains one key on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal

import yaml

from armor_megatron.config.schema import RunConfig
from armor_megatron.config.typed import ConfigError, field_types

DOC_PATH = "docs/config.md"
REGENERATE = "python tools/config_docs.py"
ITEM = "[]"  # the items of a list of sections: eval.datasets[].name


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One key: ``key`` is dotted (``algorithm.tis.cap``); a section's entry has ``keys``."""

    key: str
    type: str
    default: str
    accepted: str
    doc: str
    keys: tuple[str, ...] = ()  # a section's own keys, in schema order

    @property
    def is_section(self) -> bool:
        """Whether this entry is a section (it has keys) rather than a value."""
        return bool(self.keys)


def key_docs(cls: type = RunConfig) -> dict[str, KeyDoc]:
    """Every key of ``cls`` and its sections, in schema order; a section precedes its keys."""
    return dict(_built_key_docs(cls))


@functools.cache
def _built_key_docs(cls: type) -> types.MappingProxyType[str, KeyDoc]:
    """`key_docs`, built once per schema class.

    The schema and its checks' descriptions are fixed when it is imported, and every refused config
    (``--check``, a sweep's runs) explains its key.
    """
    out: dict[str, KeyDoc] = {}
    _walk(cls, "", out)
    return types.MappingProxyType(out)


def missing_docs(cls: type = RunConfig) -> list[str]:
    """Keys without a help text, checks without a ``describe`` and sections without a docstring."""
    problems = []
    for key, entry in key_docs(cls).items():
        if not entry.doc:
            problems.append(f"{key}: no {'docstring' if entry.is_section else 'help text'}")
        if entry.accepted == _UNDESCRIBED:
            problems.append(f"{key}: its check has no describe (use typed.described)")
    return problems


def explain(key: str) -> str:
    """The reference entry of one key (``eval.datasets[0].path`` reads as ``eval.datasets[].path``).

    An unknown key raises ConfigError with the closest known one.
    """
    docs = _built_key_docs(RunConfig)
    name = _normalise(key)
    if name not in docs:
        close = difflib.get_close_matches(name, list(docs), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (every key: {DOC_PATH})"
        raise ConfigError(key, "not a config key" + hint)
    entry = docs[name]
    if entry.is_section:
        lines = [f"{entry.key}: section", f"  {entry.doc}", "  keys:"]
        lines += [f"    {k}: {docs[k].type}" for k in entry.keys]
        return "\n".join(lines)
    lines = [f"{entry.key}", f"  type:     {entry.type}", f"  default:  {entry.default}"]
    if entry.accepted:
        lines.append(f"  accepted: {entry.accepted}")
    lines.append(f"  {entry.doc}")
    return "\n".join(lines)


def schema_key(key: str) -> str | None:
    """The reference's spelling of ``key``, or None when it names no key.

    ``key`` as the reference names it, or None when it names no key (``eval.datasets[0].k`` ->
    ``eval.datasets[].k``).
    """
    name = _normalise(key)
    return name if name in _built_key_docs(RunConfig) else None


def render_markdown() -> str:
    """The whole ``docs/config.md``."""
    docs = key_docs()
    out = [
        "# Config reference",
        "",
        f"<!-- generated from armor_megatron/config/schema.py by `{REGENERATE}`; do not edit -->",
        "",
        "Every key of a run config, section by section: its type, its default, the values it accepts",
        "and what it does. A YAML file sets them by section (`algorithm: {alpha: 0.875}`), the command",
        "line by dotted key (`armor-train --config run.yaml algorithm.alpha=0.875`), and",
        "`armor-train --explain KEY` prints one entry. A key shown as `required` has no default.",
        "Checks that involve several keys (`armor-train --check`) are not listed here; their",
        "messages name the keys.",
        "",
    ]
    top = docs[""]
    out += ["## Top level", "", _text(top.doc), "", *_table([docs[k] for k in top.keys if not docs[k].is_section])]
    for key, entry in docs.items():
        if not entry.is_section or not key:
            continue
        out += [f"## `{key}`", "", _text(entry.doc), ""]
        own = [docs[k] for k in entry.keys if not docs[k].is_section]
        subs = [k for k in entry.keys if docs[k].is_section]
        if own:
            out += _table(own)
        if subs:
            out += ["Sections: " + ", ".join(f"`{k}`" for k in subs) + ".", ""]
    return "\n".join(out).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------- building

_UNDESCRIBED = "<undescribed check>"


def _walk(cls: type, prefix: str, out: dict[str, KeyDoc]) -> None:
    hints = field_types(cls)
    own = []
    section = KeyDoc(prefix, "section", "", "", _docstring(cls))
    out[prefix] = section
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        own.append(key)
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            _walk(tp, key, out)
            continue
        item = _section_item(tp)
        check = f.metadata.get("check")
        accepted = "" if check is None else getattr(check, "describe", _UNDESCRIBED)
        out[key] = KeyDoc(key, _type_text(tp), _default_text(f), accepted, f.metadata.get("help", ""))
        if item is not None:
            _walk(item, key + ITEM, out)
    out[prefix] = dataclasses.replace(section, keys=tuple(own))


def _docstring(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses write when there is no docstring
        return ""
    return " ".join(doc.split())


def _section_item(tp: Any) -> type | None:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        item = args[0] if args else Any
        return "list of mappings" if dataclasses.is_dataclass(item) else f"list of {_type_text(item)}"
    if origin is dict or tp is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").strip()


def _normalise(key: str) -> str:
    out, depth = [], 0
    for ch in key.strip():
        if ch == "[":
            depth += 1
            out.append(ITEM)
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _text(text: str) -> str:
    """Markdown for plain text: ``<name>`` would read as an HTML tag."""
    return text.replace("<", "\\<")


def _table(entries: list[KeyDoc]) -> list[str]:
    rows = ["| key | type | default | accepted | meaning |", "|---|---|---|---|---|"]
    for e in entries:
        default = e.default if e.default == "required" else f"`{e.default}`"
        cells = [f"`{e.key}`", _text(e.type), default, _text(e.accepted), _text(e.doc)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows + [""]
