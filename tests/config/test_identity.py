"""One run, one checkpoint directory: default per-name directories, the run record, and the
refusal to resume another run's checkpoints."""

import os

import pytest
import yaml

from armor_megatron.config import ConfigError, load_config
from armor_megatron.config.identity import check_run_identity, defining_config, differences, write_run_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEVEN_B = os.path.join(ROOT, "configs", "qwen25_math_7b_dapo_armor.yaml")


def _run(tmp_path, *overrides):
    return load_config(SEVEN_B, [f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])


def _fake_checkpoint(cfg, step=10):
    os.makedirs(os.path.join(cfg.checkpoint.dir, f"iter_{step:07d}"))


def test_unset_checkpoint_dir_is_per_run_name():
    a = load_config(SEVEN_B, ["name=a", "algorithm.alpha=0.9"])
    b = load_config(SEVEN_B, ["name=b", "algorithm.alpha=0.875"])
    assert (a.checkpoint.dir, b.checkpoint.dir) == (os.path.join("checkpoints", "a"), os.path.join("checkpoints", "b"))
    assert load_config(SEVEN_B, ["checkpoint.dir=/x/y"]).checkpoint.dir == "/x/y"  # an explicit one is kept


def test_resuming_another_runs_checkpoint_is_refused_with_the_differences(tmp_path):
    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    second = _run(tmp_path, "algorithm.alpha=0.875")
    with pytest.raises(ConfigError) as err:
        check_run_identity(second, "auto")
    line = str(err.value)
    assert line.startswith("checkpoint.dir: ") and "\n" not in line
    assert "another run (algorithm.alpha: 0.9375 -> 0.875)" in line and "--resume force" in line
    check_run_identity(second, "force")  # forced
    check_run_identity(second, "none")  # starts fresh
    # an explicit path into that run's root: checkpoint.resume is what points there, so it is named
    other = os.path.join(first.checkpoint.dir, "iter_0000010")
    elsewhere = _run(tmp_path, "algorithm.alpha=0.875", f"checkpoint.dir={tmp_path / 'mine'}")
    with pytest.raises(ConfigError) as err:
        check_run_identity(elsewhere, other)
    line = str(err.value)
    assert line.startswith(f"checkpoint.resume: {other} holds the checkpoints of another run (algorithm.alpha: ")
    assert "name a checkpoint of this run in checkpoint.resume (or --resume)" in line


def test_the_config_own_errors_come_before_what_it_names_on_this_machine(tmp_path, capsys):
    """A layout that does not fit is reported first, not the files or the checkpoint directory it would resume."""
    from armor_megatron.cli.train import main

    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    args = ["--config", SEVEN_B, "--check", f"checkpoint.dir={tmp_path / 'ckpt'}", "algorithm.alpha=0.875"]
    assert main([*args, "launch.gpu_memory_gib=8"]) == 2
    assert capsys.readouterr().err.startswith("armor-train: error: plan: ")


def test_the_same_run_resumes_with_other_lengths_resources_and_urls(tmp_path):
    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    again = _run(
        tmp_path,
        "train.steps=900",
        "parallelism.tp=4",
        "launch.nodes=2",
        "rollout.sglang.urls=[http://n1:30000]",
        "anchor.reference_urls=[http://n2:30000]",
        "logging.dir=/elsewhere",
        "checkpoint.keep_last=9",
        "eval.every_steps=50",
    )
    check_run_identity(again, "auto")
    assert differences(yaml.safe_load(open(os.path.join(first.checkpoint.dir, "run_config.yaml"))), again) == []


def test_no_checkpoint_or_no_record_means_nothing_to_refuse(tmp_path):
    first = _run(tmp_path)
    write_run_record(first)  # a run that died before its first checkpoint
    check_run_identity(_run(tmp_path, "optimizer.lr=2e-6"), "auto")
    os.remove(os.path.join(first.checkpoint.dir, "run_config.yaml"))
    _fake_checkpoint(first)  # checkpoints written before run records existed
    check_run_identity(_run(tmp_path, "optimizer.lr=2e-6"), "auto")


def test_defining_config_leaves_out_paths_step_counts_and_resume_options(tmp_path):
    flat = defining_config(
        {"name": "x", "train": {"steps": 5, "seed": 1}, "checkpoint": {"resume": "auto"}, "logging": {}}
    )
    assert flat == {"name": "x", "train.seed": 1}


def test_record_redacts_nothing_it_needs_and_round_trips(tmp_path):
    cfg = _run(tmp_path)
    path = write_run_record(cfg)
    assert path == os.path.join(cfg.checkpoint.dir, "run_config.yaml")
    recorded = yaml.safe_load(open(path))
    assert recorded["algorithm"]["alpha"] == cfg.algorithm.alpha and recorded["name"] == cfg.name


def test_train_refuses_before_building_anything(tmp_path):
    from armor_megatron.trainer.run import train

    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    with pytest.raises(ConfigError, match="holds the checkpoints of another run"):
        train(_run(tmp_path, "name=other"))


def test_a_record_from_before_a_key_existed_reads_it_as_its_default(tmp_path):
    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    path = os.path.join(first.checkpoint.dir, "run_config.yaml")
    record = yaml.safe_load(open(path))
    del record["moe"]  # recorded by a version without these keys
    del record["algorithm"]["tis"]
    yaml.safe_dump(record, open(path, "w"))
    check_run_identity(_run(tmp_path), "auto")
    with pytest.raises(ConfigError, match=r"another run \(moe.router_dtype: 'fp32' -> 'fp64'\)"):
        check_run_identity(_run(tmp_path, "moe.router_dtype=fp64"), "auto")


def test_memory_and_speed_settings_do_not_define_a_run(tmp_path):
    first = _run(tmp_path)
    write_run_record(first)
    _fake_checkpoint(first)
    again = _run(
        tmp_path,
        "train.micro_batch_size=1",
        "train.max_tokens_per_micro_batch=20000",
        "train.recompute=selective",
        "throughput.overlap_grad_reduce=false",
    )
    check_run_identity(again, "auto")
