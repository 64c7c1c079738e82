"""A fresh run of the tiny seeded config against the checked-in golden metrics trace (losses,
rewards, log-prob statistics per step; `tests.trainer.golden_trace` states the run and the
tolerances). A numeric change shows as a diff here; ``python tools/golden_trace.py`` rewrites the
file when the change is meant."""

import pytest

from tests.trainer import golden_trace

pytestmark = pytest.mark.timeout(300)


def test_a_fresh_run_matches_the_golden_trace(tmp_path, world_of_one):
    fresh = golden_trace.run_trace(tmp_path)
    golden = golden_trace.read()
    assert sorted(golden, key=int) == [str(s) for s in range(golden_trace.STEPS + 1)]
    assert all(key in golden["1"] for key in ("train/loss", "rollout/reward", "train/entropy", "train/approx_kl_ref"))
    diff = golden_trace.differences(golden, fresh)
    assert not diff, (
        "the run's numbers moved (python tools/golden_trace.py rewrites the trace if meant):\n" + "\n".join(diff)
    )


def test_the_comparison_sees_a_moved_number():
    golden = golden_trace.read()
    moved = {step: dict(values) for step, values in golden.items()}
    moved["2"]["train/loss"] = golden["2"]["train/loss"] * 1.01 + 1e-6
    assert [line.split(":")[0] for line in golden_trace.differences(golden, moved)] == ["step 2 train/loss"]
    del moved["2"]["train/loss"]
    assert golden_trace.differences(golden, moved) == [
        f"step 2 train/loss: golden {golden['2']['train/loss']}, fresh -"
    ]
