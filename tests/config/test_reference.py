"""The config reference: every key of the schema documented, ``docs/config.md`` current, one key explained."""

import dataclasses
import importlib.util
import os
from typing import Literal

import pytest

from armor_megatron.config import ConfigError
from armor_megatron.config.reference import (
    DOC_PATH,
    REGENERATE,
    explain,
    key_docs,
    missing_docs,
    render_markdown,
    schema_key,
)
from armor_megatron.config.typed import at_least, checked, in_range

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_key_section_and_check_of_the_schema_is_described():
    assert missing_docs() == [], "describe them in armor_megatron/config/schema.py:\n" + "\n".join(missing_docs())


def test_docs_config_md_is_current():
    with open(os.path.join(ROOT, DOC_PATH), encoding="utf-8") as f:
        assert f.read() == render_markdown(), f"{DOC_PATH} is stale: run `{REGENERATE}`"


def test_the_tool_reports_a_stale_file_with_the_command_that_regenerates_it(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("config_docs", os.path.join(ROOT, "tools", "config_docs.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--check"]) == 0
    monkeypatch.setattr(tool, "render_markdown", lambda: render_markdown() + "| `new.key` | int |\n")
    assert tool.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == f"config_docs: {DOC_PATH} is stale; run `{REGENERATE}`"


@dataclasses.dataclass
class _Inner:
    """A section."""

    mode: Literal["a", "b"] | None = checked("a", help="which one")


@dataclasses.dataclass
class _Outer:
    """The top."""

    count: int = checked(check=at_least(2), help="how many")
    rate: float = checked(0.5, check=in_range(0, 1, lo_open=True), help="a rate")
    names: list[str] = checked(factory=lambda: ["x"], help="some names")
    undocumented: int = 3
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    silent: int = checked(1, check=lambda n: None, help="a check without words")


def test_entries_carry_type_default_range_and_doc_and_name_what_is_missing():
    docs = key_docs(_Outer)
    assert (docs["rate"].type, docs["rate"].default, docs["rate"].accepted, docs["rate"].doc) == (
        "float",
        "0.5",
        "(0, 1]",
        "a rate",
    )
    assert (docs["count"].default, docs["count"].accepted) == ("required", ">= 2")
    assert (docs["names"].type, docs["names"].default) == ("list of str", "[x]")
    assert (docs["inner.mode"].type, docs["inner"].keys, docs["inner"].doc) == (
        "a | b | null",
        ("inner.mode",),
        "A section.",
    )
    assert missing_docs(_Outer) == [
        "undocumented: no help text",
        "silent: its check has no describe (use typed.described)",
    ]


def test_explain_one_key_a_list_item_key_and_a_section():
    assert explain("algorithm.alpha").splitlines() == [
        "algorithm.alpha",
        "  type:     float",
        "  default:  0.9375",
        "  accepted: (0, 1]",
        "  mixed-ratio weight; 1 = plain PPO ratio",
    ]
    assert explain("eval.datasets[3].path").startswith("eval.datasets[].path\n  type:     str\n  default:  required")
    assert "    algorithm.overlong.buffer_len: int" in explain("algorithm.overlong")
    with pytest.raises(
        ConfigError, match=r"^rollout.tempreature: not a config key \(did you mean 'rollout.temperature'\?\)$"
    ):
        explain("rollout.tempreature")
    assert schema_key("eval.datasets[0].k") == "eval.datasets[].k" and schema_key("model") == "model"
    assert schema_key("nonsense.key") is None and schema_key("") == ""


def test_every_markdown_table_row_has_five_cells():
    for line in render_markdown().splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("|") == 6, line
