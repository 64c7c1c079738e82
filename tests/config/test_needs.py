"""``config.needs``: what a config's settings need on the job's machines, said by ``--check`` and probed
on this machine (which has neither APEX, Transformer Engine, DeepEP nor SGLang)."""

import os
import sys

import pytest

from armor_megatron.cli.train import main
from armor_megatron.config import ConfigError, load_config, needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")  # 8 GPUs, spec auto, SGLang engines
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # CPU, local spec, local engine
RECIPES = sorted(
    os.path.join(ROOT, "configs", f) for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")
)


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipes_need_only_what_the_lock_files_install(path):
    """No recipe turns on a setting a pip-only image (tools/envs/*.lock) cannot run: APEX, a compiler, DeepEP."""
    required = {n.key for n in needs.needs(load_config(path)) if n.required}
    assert required <= {"rollout.sglang.python", "rollout.sglang.weight_sync", "model.spec"}, required


def test_check_says_what_the_settings_need(capsys):
    overrides = ["throughput.gradient_accumulation_fusion=true", "throughput.torch_compile=true", "model.spec=te"]
    assert main(["--config", SEVEN_B, "--check", "--no-files", *overrides]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "the job's machines need" in ln)
    assert (
        "APEX's fused_weight_gradient_mlp_cuda (NVIDIA Apex built from source) [throughput.gradient_accumulation_fusion]"
        in line
    )
    assert "Triton and a C compiler" in line and "[throughput.torch_compile]" in line
    assert "Transformer Engine with its torch extension" in line and "[model.spec]" in line
    assert "sglang importable by the trainer's interpreter [rollout.sglang.python]" in line
    assert main(["--config", SEVEN_B, "--check", "--no-files"]) == 0
    assert (
        "Transformer Engine with its torch extension (transformer_engine, transformer_engine_torch) [model.spec, optional]"
        in capsys.readouterr().err
    )
    assert needs.describe(load_config(TINY)) is None  # CPU, local spec, local engine: nothing beyond setup.py


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["throughput.gradient_accumulation_fusion=true"],
            "throughput.gradient_accumulation_fusion: needs APEX's fused_weight_gradient_mlp_cuda (NVIDIA Apex built "
            "from source), but here fused_weight_gradient_mlp_cuda not importable (docs/gpu.md, GPU environments)",
        ),
        (["model.spec=te"], "model.spec: needs Transformer Engine with its torch extension"),
        (["moe.token_dispatcher_type=flex"], "moe.token_dispatcher_type: needs DeepEP"),
        (["rollout.sglang.python=/nonexistent/bin/python"], "/nonexistent/bin/python: no such interpreter"),
        (
            [],
            f"rollout.sglang.python: needs sglang importable by the trainer's interpreter, but here sglang not importable by {sys.executable}",
        ),
        ([f"rollout.sglang.python={sys.executable}"], f"but here sglang not importable by {sys.executable}"),
    ],
)
def test_this_machine_is_probed_in_one_line(overrides, message):
    cfg = load_config(SEVEN_B, overrides)
    with pytest.raises(ConfigError) as err:
        needs.check(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_attached_servers_and_the_optional_te_need_nothing_here():
    needs.check(load_config(SEVEN_B, ['rollout.sglang.urls=["http://h:30000"]']))  # spec auto: TE optional


def test_the_sglang_interpreter_is_asked_in_a_subprocess(tmp_path, monkeypatch):
    """A separate interpreter that finds sglang (a package on its PYTHONPATH) passes; without it, it fails."""
    cfg = load_config(SEVEN_B, [f"rollout.sglang.python={sys.executable}"])
    with pytest.raises(ConfigError, match="sglang not importable"):
        needs.check(cfg)
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    needs.check(cfg)


def test_torch_compile_on_cpu_needs_a_cxx_compiler(monkeypatch, tmp_path):
    cfg = load_config(TINY, ["throughput.torch_compile=true"])
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"throughput.torch_compile: needs a C\+\+ compiler .* no compiler found"):
        needs.check(cfg)
    monkeypatch.setenv("CXX", "/usr/bin/g++")
    needs.check(cfg)
