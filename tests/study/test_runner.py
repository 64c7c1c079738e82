"""The over-optimisation study runner: recovery's starting checkpoints, the table, and a real
two-step study (DAPO, then ARMOR recovering from DAPO's checkpoint) through ``armor-train``."""

import json
import math
import os

import pytest

from armor_megatron.study.runner import VARIANTS, _recovery_start, run_study, study_table
from armor_megatron.tasks.study_stats import variant_curves


def test_recovery_starts_from_dapos_last_checkpoint_with_its_best_as_reference(tmp_path):
    for name in ("iter_0000050", "iter_0000100", "iter_0000150", "latest"):
        (tmp_path / name).mkdir()
    hf_dir = str(tmp_path / "hf")
    records = [{"step": s, "eval/mean/pass@1": v} for s, v in ((0, 0.40), (50, 0.45), (100, 0.45), (150, 0.2))]
    policy, reference = _recovery_start(str(tmp_path), records, hf_dir)
    assert policy == str(tmp_path / "iter_0000150")
    assert reference == str(tmp_path / "iter_0000050")  # the earliest of the best
    records[0]["eval/mean/pass@1"] = 0.5
    assert _recovery_start(str(tmp_path), records, hf_dir)[1] == hf_dir  # the warm-up model is step 0
    with pytest.raises(ValueError, match="lack validation scores"):
        _recovery_start(str(tmp_path), records[:2], hf_dir)


def test_table_reports_every_variant_and_the_verdict():
    def curves(name, ends):
        return variant_curves(
            name, [[{"step": 0, "eval/mean/pass@1": 0.5}, {"step": 9, "eval/mean/pass@1": e}] for e in ends]
        )

    table = study_table(
        {"dapo": curves("dapo", [0.3, 0.32, 0.28]), "armor": curves("armor", [0.45, 0.4, 0.5])},
        {"dapo": "DAPO", "armor": "ARMOR"},
    )
    assert "| DAPO | 3 | 0.500 | 0.500 (0) | 0.300 ± 0.020 |" in table
    assert "over-optimisation seen" in table and "ARMOR beats DAPO" in table
    one = study_table(
        {"dapo": curves("dapo", [0.3]), "armor": curves("armor", [0.4])}, {"dapo": "DAPO", "armor": "ARMOR"}
    )
    assert "One seed: no verdict" in one


def test_unknown_variants_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="unknown variant"):
        run_study(str(tmp_path), ["dapo", "ppo"])
    with pytest.raises(ValueError, match="add variant dapo"):
        run_study(str(tmp_path), ["recovery"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_study_trains_recovers_and_resumes(tmp_path):
    lines = []
    task = {"task": "tagged_addition", "num_val": 16, "warmup_steps": 5, "seed": 0}
    overrides = ["train.steps=8", "eval.every_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4"]
    result = run_study(
        str(tmp_path), ["dapo", "recovery"], [1], overrides=overrides, jobs=2, task=task, log=lines.append
    )
    assert set(result.curves) == {"dapo", "recovery"} and os.path.isfile(result.png)
    dapo, recovery = result.curves["dapo"], result.curves["recovery"]
    assert dapo.steps == [0, 2, 4, 6, 8] and recovery.steps == [8, 10]  # a quarter of 8 steps, after DAPO's end
    # recovery's step-0 validation is DAPO's last checkpoint evaluated again (greedy: the same accuracy)
    assert recovery.val_mean[0] == pytest.approx(dapo.end)
    start = next(m for m in lines if m.startswith("recovery seed 1"))
    assert "dapo-s1/iter_0000008" in start and "reference" in start
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dapo"]["val_mean"] == dapo.val_mean
    assert VARIANTS["recovery"][0] in (tmp_path / "table.md").read_text()
    lines.clear()
    run_study(str(tmp_path), ["dapo", "recovery"], [1], overrides=overrides, jobs=2, task=task, log=lines.append)
    assert "dapo-s1: already done" in lines and "recovery-s1: already done" in lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_paired_study_logs_modes_and_reuses_one_warm_up_per_seed(tmp_path):
    from armor_megatron.study.runner import run_paired
    from armor_megatron.tasks.overopt_checks import decide

    lines = []
    task = {"task": "worked_addition", "num_val": 16, "warmup_steps": 5, "warmup_lr": 3e-3}
    overrides = ["train.steps=4", "eval.every_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4"]
    result = run_paired(
        str(tmp_path), ["dapo", "armor"], [1, 2], overrides=overrides, jobs=2, task=task, log=lines.append
    )
    assert sorted(os.listdir(tmp_path / "s1")) == ["hf", "train_rho0.jsonl", "train_rho1.jsonl", "val.jsonl"]
    for runs in result.runs.values():
        assert [r.steps for r in runs] == [[0, 2, 4]] * 2
        # every evaluation's share of direct responses counts 16 prompts x k=4 responses
        assert all(d * 64 == round(d * 64) for r in runs for d in r.val_d_share), [r.val_d_share for r in runs]
    # anchors' found rate: logged by every ARMOR run, by no DAPO run
    assert not any(math.isnan(r.anchor_found) for r in result.runs["armor"])
    assert all(math.isnan(r.anchor_found) for r in result.runs["dapo"])
    assert result.cpu_minutes > 0 and os.path.isfile(result.png)
    decision = decide(result.runs["dapo"], result.runs["armor"], None)
    assert decision.verdict == "no claim" and decision.test is not None and decision.test.n == 2
    lines.clear()
    run_paired(str(tmp_path), ["dapo", "armor"], [1, 2], overrides=overrides, jobs=2, task=task, log=lines.append)
    assert "dapo-s1: already done" in lines and "armor-s2: already done" in lines
