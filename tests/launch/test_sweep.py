import json
import os

import pytest
import yaml

from armor_megatron.cli.sweep import main
from armor_megatron.config import load_config, to_dict
from armor_megatron.launch.sweep import SweepError, expand_grid, parse_grid, plan_sweep, write_sweep
from tests.launch.conftest import ROOT

BASE = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")


def test_parse_grid_resolves_aliases_and_yaml_values():
    grid = parse_grid(["alpha=0.875,0.9375", "tau=80,160", "G=[8,16]", "seed=1", "anchor.enabled=true,false"])
    assert grid == {
        "algorithm.alpha": [0.875, 0.9375],
        "reference.tau": [80, 160],
        "rollout.group_size": [8, 16],
        "train.seed": [1],
        "anchor.enabled": [True, False],
    }


@pytest.mark.parametrize(
    "items, message",
    [
        (["alpha"], "give values as key=v1,v2"),
        (["alpha=0.9,0.9"], "repeats a value"),
        (["alpha=0.9", "algorithm.alpha=0.8"], "given twice"),
        (["name=a,b"], "set per run by the sweep itself"),
    ],
)
def test_bad_grids(items, message):
    with pytest.raises(SweepError, match=message):
        parse_grid(items)


def test_expand_grid_first_key_slowest():
    assert expand_grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"},
        {"a": 1, "b": "y"},
        {"a": 2, "b": "x"},
        {"a": 2, "b": "y"},
    ]


def test_plan_sweep_names_counts_and_validated_configs(tmp_path):
    grid = parse_grid(["alpha=0.875,0.9375", "tau=80,160", "seed=1,2,3"])
    sweep = plan_sweep(BASE, grid, str(tmp_path / "alpha-tau"), fixed_overrides=["train.steps=300"], max_parallel=4)
    assert len(sweep.runs) == 2 * 2 * 3
    run = sweep.runs[5]  # alpha 0.875 (first half), tau 160 (second of two), seed 3 (third of three)
    assert run.name == "qwen25-math-7b-dapo-armor-alpha0.875-tau160-seed3"
    cfg = run.config
    assert (cfg.algorithm.alpha, cfg.reference.tau, cfg.train.seed, cfg.train.steps) == (0.875, 160, 3, 300)
    assert cfg.name == run.name and cfg.checkpoint.dir == os.path.join("checkpoints", run.name)
    assert cfg.logging.dir == os.path.join("runs", run.name)
    assert len({r.name for r in sweep.runs}) == 12
    assert sweep.sbatch[sweep.sbatch.index("--array=0-11%4")] and sweep.sbatch[-2:] == (
        "--config",
        os.path.join(str(tmp_path / "alpha-tau"), "configs", "%a.yaml"),
    )
    assert "--job-name=alpha-tau" in sweep.sbatch and "--output=runs/slurm/%x-%A_%a.out" in sweep.sbatch


def test_names_use_the_whole_key_when_last_parts_clash(tmp_path):
    grid = parse_grid(["rollout.temperature=0.8,1.0", "eval.temperature=0.6"])
    sweep = plan_sweep(BASE, grid, str(tmp_path / "s"))
    assert sweep.runs[0].name == "qwen25-math-7b-dapo-armor-rollout_temperature0.8-eval_temperature0.6"


def test_a_run_that_fails_validation_names_its_grid_values(tmp_path):
    with pytest.raises(SweepError, match=r"run 1 \(algorithm.alpha=1.5\): algorithm.alpha: 1.5 is out of range"):
        plan_sweep(BASE, {"algorithm.alpha": [0.9, 1.5]}, str(tmp_path / "s"))
    with pytest.raises(SweepError, match="changes the launch section"):
        plan_sweep(BASE, {"launch.time": ["1:00:00", "2:00:00"]}, str(tmp_path / "s"))
    with pytest.raises(SweepError, match="rollout.sglang.tp_per_engine: 3 does not divide"):
        plan_sweep(BASE, {"rollout.sglang.tp_per_engine": [1, 3]}, str(tmp_path / "s"))


def test_write_sweep_files_reload_to_the_same_runs(tmp_path):
    out = tmp_path / "sweeps" / "g"
    sweep = plan_sweep(BASE, parse_grid(["G=8,16", "seed=1,2"]), str(out), max_parallel=2)
    write_sweep(sweep)
    assert sorted(os.listdir(out / "configs")) == ["0.yaml", "1.yaml", "2.yaml", "3.yaml"]
    for run in sweep.runs:
        assert to_dict(load_config(str(out / "configs" / f"{run.index}.yaml"))) == to_dict(run.config)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == [r.name for r in sweep.runs]
    assert manifest["runs"][3]["values"] == {"rollout.group_size": 16, "train.seed": 2}
    assert manifest["sbatch"] == list(sweep.sbatch)
    assert [p for p in os.listdir(out.parent) if p != "g"] == []  # no temporary directory left behind
    with pytest.raises(SweepError, match="already exists"):
        write_sweep(sweep)
    write_sweep(sweep, overwrite=True)


def test_command_line_dry_run_writes_nothing(tmp_path, capsys):
    out = tmp_path / "s"
    assert (
        main(["--config", BASE, "--out", str(out), "--grid", "alpha=0.875,0.9375", "--max-parallel", "1", "--dry-run"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "0\tqwen25-math-7b-dapo-armor-alpha0.875\talgorithm.alpha=0.875"
    assert lines[-1].startswith("sbatch --job-name=s --nodes=1 --gpus-per-node=8 ") and "--array=0-1%1" in lines[-1]
    assert not out.exists()
    assert main(["--config", BASE, "--out", str(out), "--grid", "alpha=0.875,0.9375"]) == 0
    assert (out / "configs" / "1.yaml").exists()


def test_command_line_grid_file_and_one_line_errors(tmp_path, capsys):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump({"alpha": [0.875, 0.9375], "rollout.temperature": [0.7, 1.0]}))
    assert main(["--config", BASE, "--out", str(tmp_path / "s"), "--grid-file", str(grid_file), "--dry-run"]) == 0
    assert "alpha0.9375-temperature1.0" in capsys.readouterr().out
    assert main(["--config", BASE, "--out", str(tmp_path / "s"), "--grid", "algorithm.alpah=0.9", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "armor-sweep: error: run 0 (algorithm.alpah=0.9): algorithm.alpah: unknown key (did you mean 'alpha'?)"
    )
