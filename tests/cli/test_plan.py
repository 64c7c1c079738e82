"""``armor-train --config F --plan``: every recipe fits, its README shows the table, a 70B at TP=1/PP=1 is refused."""

import glob
import os

import pytest

from armor_megatron.cli.train import main
from armor_megatron.config import load_config
from armor_megatron.config.validate import model_arch_of
from armor_megatron.launch.memory import plan_memory

RECIPES = sorted(
    os.path.basename(p)[: -len(".yaml")]
    for p in glob.glob("configs/*.yaml")
    if not os.path.basename(p).startswith(("tiny", "gpu_check"))
)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_fits_and_its_readme_shows_the_plan(name, capsys):
    assert main(["--config", f"configs/{name}.yaml", "--plan"]) == 0  # model files not needed
    table = capsys.readouterr().out.strip()
    assert table.startswith("memory plan:") and table.endswith("fits launch.gpu_memory_gib 80")
    with open(f"examples/{name}/README.md") as f:
        assert table in f.read(), f"examples/{name}/README.md: memory table differs from --plan"


def test_a_70b_layout_without_model_parallelism_is_refused_with_one_line(capsys):
    args = ["parallelism.tp=1", "parallelism.pp=1", "parallelism.vpp=null", "parallelism.sp=false"]
    assert main(["--config", "configs/llama3_70b_armor.yaml", "--plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("armor-train: error: plan: tp=1 pp=1")
    assert "launch.gpu_memory_gib 80 (largest: gradients (fp32)" in err


def test_a_smaller_gpu_is_refused(capsys):
    assert main(["--config", "configs/qwen3_8b_base_two_stage.yaml", "--plan", "launch.gpu_memory_gib=40"]) == 2
    assert "> launch.gpu_memory_gib 40" in capsys.readouterr().err


def test_plan_matches_the_library():
    cfg = load_config("configs/qwen3_8b_base_two_stage.yaml")
    assert plan_memory(cfg, model_arch_of(cfg)).problem() is None


def test_check_refuses_a_layout_over_the_gpu_memory_unless_no_plan(capsys):
    args = ["--config", "configs/qwen25_math_7b_dapo_armor.yaml", "--check", "--no-files", "train.recompute=none"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("armor-train: error: plan: tp=2 pp=1 dp=4")
    assert "86.7 GiB per GPU in phase 'update' (colocated) > launch.gpu_memory_gib 80" in err
    assert err.rstrip().endswith("pass --no-plan to accept it")
    assert main([*args, "--no-plan"]) == 0
    assert main(args[:-1]) == 0  # the recipe as it is (full recompute) fits


def test_plan_prints_the_peak_of_every_phase_for_both_placements(capsys):
    assert main(["--config", "configs/qwen25_math_7b_dapo_armor.yaml", "--plan"]) == 0
    colocated = capsys.readouterr().out
    assert "| phase (colocated step) | stage 0 |" in colocated
    for phase in ("rollout", "update", "weights pushed to the policy engine", "checkpoint", "**peak**"):
        assert f"| {phase} |" in colocated, phase
    disaggregated = ["rollout.sglang.placement=disaggregated", "launch.nodes=2", "launch.engine_gpus=8"]
    assert main(["--config", "configs/qwen25_math_7b_dapo_armor.yaml", "--plan", *disaggregated]) == 0
    out = capsys.readouterr().out
    assert "| phase (disaggregated step) | stage 0 |" in out and "| phase (engine GPU) | GiB |" in out
