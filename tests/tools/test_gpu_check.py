"""tools/gpu_check.sh: the first-GPU acceptance check. Its CPU mode (gloo, small sizes) runs
every check here; the GPU run is skipped unless torch sees a CUDA device. The checks' own
verdicts are tested too: a wrong checkpoint fails parity, a run without its reset or resume
fails the train check, and the FLOP formula counts the matmuls transformers' model has."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu_check"))

import check_train  # noqa: E402

VERDICT = re.compile(r"^gpu_ok=([01]) tokens_per_s=(\S+) mfu=(\S+)$")


def run_script(*args, timeout=540, **env):
    full_env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    full_env.pop("OUT", None)
    return subprocess.run(
        ["bash", SCRIPT, *args], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def lines_of(proc) -> dict:
    """{"parity": line, ..., "verdict": last line}."""
    lines = proc.stdout.strip().splitlines()
    out = {line.split(":")[0]: line for line in lines if re.match(r"^(parity|train|throughput|memory):", line)}
    out["verdict"] = lines[-1] if lines else ""
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_mode_runs_all_three_checks_and_prints_the_verdict_last(tmp_path):
    proc = run_script("--device", "cpu", "--work", str(tmp_path), "--logs", str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = lines_of(proc)
    for name in ("parity", "train", "throughput", "memory"):
        assert lines[name].startswith(f"{name}: ok=1 "), lines
    # no GPU was proven: gpu_ok stays 0 while the throughput numbers are real
    gpu_ok, tokens_per_s, mfu = VERDICT.match(lines["verdict"]).groups()
    assert gpu_ok == "0" and float(tokens_per_s) > 0 and 0 < float(mfu) < 1
    results = json.loads((tmp_path / "logs" / "gpu_check.json").read_text())
    assert results["parity"]["fp32"]["max_abs"] <= 1e-4 and results["parity"]["bf16"]["rel_l2"] <= 1e-2
    steps = results["train"]["metrics"]
    assert steps["2"]["reference/reset"] == 1.0 and steps["3"]["train/num_tokens"] > 0
    assert all(steps[s]["train/tis_num_tokens"] > 0 for s in ("1", "2", "3"))  # TIS at T = 0.7 ran
    assert results["throughput"]["tokens_per_s"] == pytest.approx(float(tokens_per_s), rel=1e-3)
    assert "armor-train" in (tmp_path / "logs" / "gpu_check.log").read_text()
    # the memory check ran the colocated trainer's phases through the ledger
    memory = results["memory"]
    assert memory["ok"] and memory["line"].startswith("memory: ok=1 tiny bf16 actor + reference")
    assert [p["phase"] for p in memory["phases"]] == [
        "trainer to the device",
        "logprobs",
        "logprobs",
        "update",
        "trainer to the host + empty_cache",
        "weights pushed to the policy engine",
    ]
    planned = {p["phase"]: p["ledger"] for p in memory["phases"]}
    assert planned["trainer to the host + empty_cache"] == 0 < planned["trainer to the device"] < planned["update"]
    # the summary: the four checks proven on the CPU, the optional ones skipped with why
    summary = next(line for line in proc.stdout.splitlines() if "proven on cpu" in line)
    assert summary.startswith("gpu_check: proven on cpu: parity, train, throughput, memory; not proven: te (")
    assert "sglang (SGLang needs CUDA (--device cpu))" in summary and "not asked" not in summary


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(600)
def test_gpu_run_passes(tmp_path):
    proc = run_script("--work", str(tmp_path), "--logs", str(tmp_path))
    assert VERDICT.match(lines_of(proc)["verdict"]).group(1) == "1", proc.stdout[-4000:]
    assert proc.returncode == 0


@pytest.mark.slow  # tools/gpu_check.sh in a fresh interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_cuda_asked_without_a_device_fails_with_a_verdict(tmp_path):
    proc = run_script("--work", str(tmp_path), timeout=120)
    assert proc.returncode == 1
    assert "torch sees no CUDA device" in proc.stdout
    assert VERDICT.match(lines_of(proc)["verdict"]).groups() == ("0", "nan", "nan")


def test_unknown_check_is_refused_in_one_line(tmp_path):
    proc = run_script("--device", "cpu", "--work", str(tmp_path), "--only", "parity,speed", timeout=120)
    assert proc.returncode == 2 and "unknown check(s) speed" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parity_fails_when_the_megatron_weights_are_not_the_models(tmp_path):
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.rollout.testing.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path / "hf"), seed=0)
    make_tiny_checkpoint(str(tmp_path / "other"), seed=1)
    convert_hf_to_mcore(str(tmp_path / "other"), str(tmp_path / "parity_mcore"), progress_stream=None)
    script = os.path.join(ROOT, "tools", "gpu_check", "check_parity.py")
    cmd = [sys.executable, script, "--hf", str(tmp_path / "hf"), "--work", str(tmp_path), "--device", "cpu"]
    cmd += ["--json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=240)
    result = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 1 and not result["ok"] and result["fp32"]["max_abs"] > 1e-2, proc.stdout[-2000:]


def good_steps() -> dict:
    step = {
        "train/num_tokens": 100.0,
        "train/skipped": 0.0,
        "train/loss": 0.1,
        "anchor/found_rate": 0.5,
        "rollout/logprob_abs_diff": 4e-3,
        "train/tis_weight_mean": 1.001,
        "train/approx_kl_ref": 0.0,
    }
    return {1: dict(step), 2: {**step, "train/approx_kl_ref": 1e-3, "reference/reset": 1.0}, 3: dict(step)}


RESUMED = "[armor] resumed from /x/ckpt/iter_0000002 at step 2\n"


def test_train_verdict_accepts_a_run_that_did_everything():
    assert check_train.problems(good_steps(), RESUMED, "iter_0000003") == []


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m: m[2].pop("reference/reset"), "no reference reset at step 2"),
        (lambda m: m[3].update({"train/approx_kl_ref": 1e-3}), "π_ref != π_θ"),
        (lambda m: m[1].update({"train/skipped": 1.0}), "step 1 did not update"),
        (lambda m: m[2].update({"train/loss": float("nan")}), "step 2 loss nan"),
        (lambda m: m[3].pop("anchor/found_rate"), "step 3 has no anchor metrics"),
        (lambda m: m[1].update({"rollout/logprob_abs_diff": 0.5}), "engine/trainer log-prob gap"),
        (lambda m: m[2].update({"train/tis_weight_mean": 1.3}), "step 2 TIS weight mean 1.3"),
        (lambda m: m[3].pop("train/tis_weight_mean"), "step 3 TIS weight mean None"),
        (lambda m: m.pop(3), "no metrics for steps [3]"),
    ],
)
def test_train_verdict_names_what_went_wrong(change, expected):
    metrics = good_steps()
    change(metrics)
    found = check_train.problems(metrics, RESUMED, "iter_0000003")
    assert any(expected in p for p in found), found


def test_train_verdict_needs_the_resume_and_the_last_checkpoint():
    found = check_train.problems(good_steps(), "started fresh\n", "iter_0000002")
    assert "the second process did not resume at step 2" in found
    assert "latest checkpoint is iter_0000002, not iter_0000003" in found


@pytest.mark.parametrize("check, why", [("te", "transformer_engine"), ("sglang", "SGLang needs CUDA")])
def test_an_optional_check_that_cannot_run_is_skipped_in_one_line_naming_why(tmp_path, check, why):
    script = os.path.join(ROOT, "tools", "gpu_check", f"check_{check}.py")
    cmd = [sys.executable, script, "--hf", str(tmp_path / "hf"), "--work", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(cmd + ["--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    result = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 0 and result["skipped"] and proc.stdout.count("\n") == 1
    assert result["line"].startswith(f"{check}: ok=1 skipped: ") and why in result["line"]


def test_the_sglang_check_names_the_interpreter_that_lacks_sglang(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_sglang", os.path.join(ROOT, "tools", "gpu_check", "check_sglang.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("SGLANG_PYTHON", sys.executable)
    assert (
        module.missing("cuda")
        == f"sglang not importable by {sys.executable} (set SGLANG_PYTHON to the SGLang environment's)"
    )


def test_the_summary_says_what_was_and_was_not_proven():
    """The summary line of a run asked for some checks (the CPU-mode run above checks a whole one)."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check_main", os.path.join(ROOT, "tools", "gpu_check", "__main__.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(device="cpu", only=["memory", "train", "te", "sglang"])
    results = {
        "memory": {"ok": True, "line": "memory: ok=1 tiny bf16 actor + reference ..."},
        "train": {"ok": False, "line": "train: ok=0 step 2 loss nan"},
        "te": {"ok": True, "skipped": True, "line": "te: ok=1 skipped: transformer_engine not importable"},
        "sglang": {"ok": True, "skipped": True, "line": "sglang: ok=1 skipped: SGLang needs CUDA (--device cpu)"},
    }
    assert module.summary(args, results) == (
        "proven on cpu: memory; failed: train; not proven: te (transformer_engine not importable), "
        "sglang (SGLang needs CUDA (--device cpu)), parity (not asked), throughput (not asked)"
    )
    args.only, results = ["te"], {"te": results["te"]}
    assert module.summary(args, results).startswith("proven on cpu: nothing; not proven: te (transformer_engine")
