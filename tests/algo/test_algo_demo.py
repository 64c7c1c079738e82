"""The tiny ARMOR-vs-DAPO demo (examples/algo_demo.py) runs end to end with the library."""

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "algo_demo.py"


@pytest.mark.timeout(120)
def test_demo_runs_both_algorithms(capsys):
    spec = importlib.util.spec_from_file_location("algo_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--steps", "3", "--log-every", "3", "--warmup-steps", "20", "--tau", "2", "--prompts-per-step", "4"])
    out = capsys.readouterr().out
    assert "dapo: alpha=1.0 anchors=off" in out and "armor: alpha=0.9375 anchors=on reset=every 2" in out
    final = out.strip().splitlines()[-1]
    assert final.startswith("final: dapo train@8=") and "armor train@8=" in final and "anchor_found=" in final
