"""``armor-train --config F --plan``: every recipe fits, its README shows the tables, a 70B at TP=1/PP=1 is refused."""

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
    table, steps = capsys.readouterr().out.strip().split("\n\nstep-time model: ")
    assert table.startswith("memory plan:") and table.endswith("fits launch.gpu_memory_gib 80")
    steps = "step-time model: " + steps
    assert "\n| layout | engine GPUs (policy + reference) | trainer GPUs | generation s | train s |" in steps
    assert "\n| as configured" in steps and "\nbalance point (any engine count): " in steps
    *_, verdict, paste = steps.splitlines()  # the split, and its overrides when there is one
    assert paste.startswith("suggested split: ") or (
        verdict.startswith("suggested split: ") and paste.startswith("to run it, add: ")
    )
    with open(f"examples/{name}/README.md") as f:
        readme = f.read()
    assert table in readme, f"examples/{name}/README.md: memory table differs from --plan"
    assert steps in readme, f"examples/{name}/README.md: step-time model differs from --plan"


def test_plan_prints_off_and_one_step_and_the_split_for_a_disaggregated_recipe(capsys):
    assert main(["--config", "configs/llama3_70b_armor.yaml", "--plan"]) == 0
    out = capsys.readouterr().out
    # tp·pp = 32 of the 64 GPUs train, so 32 engine GPUs is the only split: it is the configured one
    row = "| as configured, split for one_step, split for off (disaggregated, sync distributed) | 32 (24 + 8) | 32 |"
    assert row in out
    assert "32 trainer GPUs (as configured): one_step" in out
    # a faster engine shifts the balance towards the trainer: fewer engine GPUs at the balance point
    fast = ["launch.step_time.decode_tokens_per_s_per_gpu=4000"]
    assert main(["--config", "configs/llama3_70b_armor.yaml", "--plan", *fast]) == 0
    balance = lambda text: float(text.split("balance point (any engine count): ")[1].split(" of ")[0])  # noqa: E731
    assert balance(capsys.readouterr().out) < balance(out)


@pytest.mark.parametrize("name", ["qwen25_math_7b_dapo_armor", "qwen3_8b_base_two_stage"])
def test_the_suggested_split_is_printed_as_overrides_that_make_a_valid_run(name, capsys):
    assert main(["--config", f"configs/{name}.yaml", "--plan"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("to run it, add: rollout.overlap=one_step algorithm.tis.enabled=true ")
    overrides = last.removeprefix("to run it, add: ").split()
    cfg = load_config(f"configs/{name}.yaml", overrides)
    assert cfg.rollout.sglang.placement == "disaggregated" and cfg.rollout.overlap == "one_step"
    assert main(["--config", f"configs/{name}.yaml", "--check", "--no-files", *overrides]) == 0


def test_plan_of_a_cpu_run_has_no_step_time_model(capsys):
    assert main(["--config", "configs/tiny_cpu.yaml", "--plan"]) == 0
    assert "step-time model" not in capsys.readouterr().out


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
