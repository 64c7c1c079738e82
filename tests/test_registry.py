"""The one registry pattern every variant kind uses (armor_megatron/registry.py): traits with defaults,
config keys, declared names, and one-line errors."""

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


def test_a_declared_name_is_known_before_its_definition_fills_it_in():
    reg = Registry("mode")
    reg.declare("a", "b")
    assert list(reg) == ["a", "b"] and "a" in reg
    with pytest.raises(ValueError) as err:
        reg.call("a", 1.0, 2.0)
    assert str(err.value) == "mode 'a' is declared but its definition is not registered"
    reg.register("b")(scaled)  # no replace=True needed: it fills the declared entry, in place
    assert list(reg) == ["a", "b"] and reg.call("b", 1.0, 2.0) == 2.0
    with pytest.raises(ValueError, match="already registered"):
        reg.declare("b")
