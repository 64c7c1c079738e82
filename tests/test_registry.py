"""The one registry pattern every variant kind uses (armor_megatron/registry.py): traits with defaults,
config keys, lazily named entries, and one-line errors."""

import sys
from types import SimpleNamespace

import pytest

from armor_megatron.registry import Registry


def scaled(x: float, scale: float, shift: float = 0.0) -> float:
    return x * scale + shift


def test_traits_default_and_an_undeclared_one_is_refused_in_one_line():
    reg = Registry("toy", traits={"critic": False})
    reg.register("plain")(scaled)
    reg.register("with-critic", critic=True)(scaled)
    assert reg.entry("plain").meta == {"critic": False} and reg.entry("with-critic").meta == {"critic": True}
    with pytest.raises(ValueError) as err:
        reg.register("typo", critc=True)
    assert str(err.value) == "toy 'typo': unknown trait critc; declared: critic"


def test_config_keys_supply_parameters_from_a_config_section():
    reg = Registry("toy")
    reg.register("scaled", config_keys={"scale": "factor", "shift": "offset"})(scaled)
    section = SimpleNamespace(factor=3.0, offset=1.0, unrelated=7)
    assert reg.entry("scaled").config_kwargs(section) == {"scale": 3.0, "shift": 1.0}
    assert reg.call_configured("scaled", section, 2.0) == 7.0
    assert reg.entry("scaled").required("scale") and not reg.entry("scaled").required("shift")
    with pytest.raises(ValueError) as err:
        reg.register("bad", config_keys={"factor": "factor"})(scaled)
    assert str(err.value) == "toy 'bad': config_keys name factor, which it does not take (x, scale, shift)"
    assert "bad" not in reg


def test_a_dotted_config_key_reads_a_subsection():
    reg = Registry("toy")
    reg.register("scaled", config_keys={"scale": "factor", "shift": "sub.offset"})(scaled)
    section = SimpleNamespace(factor=3.0, sub=SimpleNamespace(offset=-1.0))
    assert reg.call_configured("scaled", section, 2.0) == 5.0


def test_unknown_names_and_arguments_fail_in_one_line():
    reg = Registry("toy")
    reg.register("scaled", "alias")(scaled)
    with pytest.raises(ValueError) as err:
        reg.entry("scaeld")
    assert str(err.value) == "unknown toy 'scaeld' (did you mean 'scaled'?); known: scaled, alias"
    with pytest.raises(ValueError) as err:
        reg.call("alias", 1.0, factor=2.0)
    assert str(err.value).startswith("toy 'alias' takes (x, scale, shift): ") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("scaled")(scaled)


def test_a_lazily_named_entry_is_known_before_its_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "lazy_registry_defs.py").write_text("def doubled(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("mode")
    reg.register_lazy("double", "lazy_registry_defs:doubled")
    assert "double" in reg and "lazy_registry_defs" not in sys.modules  # membership imports nothing
    assert reg.call("double", 3) == 6 and reg.entry("double").parameters == ("x",)
    assert reg["double"] is sys.modules["lazy_registry_defs"].doubled
    with pytest.raises(ValueError, match="^mode 'bad': 'nocolon' is not 'package.module:attribute'$"):
        reg.register_lazy("bad", "nocolon")
    with pytest.raises(ValueError, match="^mode 'double' is already registered$"):
        reg.register_lazy("double", "elsewhere:doubled")
    # the named module may register the entry itself, but only the definition it was named for
    reg.register_lazy("scaled", f"{__name__}:scaled")
    reg.register("scaled", config_keys={"scale": "factor"})(scaled)
    assert reg.entry("scaled").config_keys == {"scale": "factor"}
    reg.register_lazy("other", "elsewhere:scaled")
    with pytest.raises(ValueError, match=f"^mode 'other' is named 'elsewhere:scaled', but {__name__}:scaled registers"):
        reg.register("other")(scaled)
