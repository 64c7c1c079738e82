"""megatron's ``jit_fuser`` functions: compiled at their first call and only when compiling is on."""

import subprocess
import sys

import pytest
import torch

from armor_megatron.megatron import jit_fusions

FRESH_PROCESS = """
import sys
import armor_megatron.megatron.actor  # the trainer's import of megatron-core
import megatron.core.jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
import torch
from armor_megatron.megatron.jit_fusions import set_compiling

assert megatron.core.jit.jit_fuser.__name__ == "compiled_on_first_call", megatron.core.jit.jit_fuser
assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
set_compiling(False)
y = torch.randn(6, 16)
a, b = y.chunk(2, -1)
assert torch.equal(bias_swiglu_impl(y, None), torch.nn.functional.silu(a) * b)
assert "torch._dynamo" not in sys.modules  # an eager call needs none of it
print("ok")
"""


@pytest.mark.timeout(120)
def test_megatron_core_imports_without_dynamo_and_its_fusions_run_eagerly():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", FRESH_PROCESS], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.fixture
def compiling(monkeypatch):
    """Compiling on, with ``torch.compile`` recorded: what it was given, and a call of what it returned."""
    made, calls = [], []

    def compile(fn):
        made.append(fn)
        return lambda *a, **k: calls.append(a) or fn(*a, **k)

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(jit_fusions, "_compiling", True)
    return made, calls


def test_a_function_compiles_once_at_its_first_call_when_compiling(compiling):
    made, calls = compiling

    def double(x):
        return 2 * x

    fused = jit_fusions.compiled_on_first_call(double)
    assert made == [] and fused.__name__ == "double"  # nothing compiled at decoration
    assert fused(3) == 6 and fused(4) == 8
    assert made == [double] and calls == [(3,), (4,)]


def test_a_function_runs_as_written_while_compiling_is_off(compiling, monkeypatch):
    made, calls = compiling
    monkeypatch.setattr(jit_fusions, "_compiling", False)
    fused = jit_fusions.compiled_on_first_call(lambda x: x + 1)
    assert fused(1) == 2 and made == [] and calls == []


def test_install_is_a_no_op_once_megatron_core_is_imported(monkeypatch):
    import megatron.core.jit  # noqa: F401

    before = list(sys.meta_path)
    jit_fusions.install()
    assert sys.meta_path == before
