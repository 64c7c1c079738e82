"""``armor-plot`` end to end: metrics.jsonl files written by MetricsLogger -> a PNG; bad input -> one line."""

import os
import struct
import sys

import pytest

from armor_megatron.cli.plot import NEEDS_MATPLOTLIB, main
from armor_megatron.trainer.metrics_log import MetricsLogger

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, accuracy_slope: float, reset_every: int = 0) -> str:
    """Ten logged steps the way the trainer logs them: eval at step 0 and every 5 steps, timings per step."""
    log = MetricsLogger(str(run_dir))
    log.log(0, {"eval/val/pass@1": 0.2, "eval/mean/pass@1": 0.2})
    for step in range(1, 11):
        accuracy = 0.3 + accuracy_slope * step
        metrics = {
            "rollout/on_policy_accuracy": accuracy,
            "rollout/reward": 2 * accuracy - 1,
            "anchor/found_rate": 0.5 + accuracy_slope * step,
            "time/rollout": 2.0,
            "time/logprobs": 0.5,
            "time/update": 1.5,
            "time/weight_sync": 0.2,
            "time/step": 4.5 + 0.1 * step,
        }
        if step % 5 == 0:
            val = 0.2 + accuracy_slope * step
            metrics.update({"eval/val/pass@1": val, "eval/mean/pass@1": val, "time/eval": 0.4})
        if reset_every and step % reset_every == 0:
            metrics.update({"reference/reset": 1.0, "time/reference_reset": 0.3})
        log.log(step, metrics)
    log.close()
    return str(run_dir)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_plot_two_runs_overlaid_with_extra_metric(tmp_path, capsys):
    armor = _write_run(tmp_path / "armor", 0.04, reset_every=4)
    dapo = _write_run(tmp_path / "dapo", 0.05)
    out = tmp_path / "compare.png"
    assert main([armor, dapo + "/metrics.jsonl", "--out", str(out), "--metric", "anchor/found_rate"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (2 runs)"
    width, height = _png_size(out)
    # 12 x (3.2 * 4 panels) inches at 100 dpi: accuracy, anchor/found_rate, one timing panel per run
    assert (width, height) == (1200, 1280)
    assert out.stat().st_size > 20_000  # drawn content, not a blank canvas
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_the_png_honours_the_umask(tmp_path, umask, mode):
    run = _write_run(tmp_path / "run", 0.01)
    previous = os.umask(umask)
    try:
        assert main([run, "--out", str(tmp_path / "run.png")]) == 0
    finally:
        os.umask(previous)
    assert (tmp_path / "run.png").stat().st_mode & 0o777 == mode


def test_replot_replaces_the_png(tmp_path):
    run = _write_run(tmp_path / "run", 0.01)
    out = tmp_path / "run.png"
    out.write_bytes(b"old")
    assert main([run, "--out", str(out)]) == 0
    assert _png_size(out) == (1200, 640)


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    run = _write_run(tmp_path / "run", 0.01)
    out = str(tmp_path / "x.png")

    def error(argv) -> str:
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        return lines[0]

    assert (
        error([str(tmp_path / "missing"), "--out", out])
        == f"armor-plot: error: no such run directory or metrics file: {tmp_path / 'missing'}"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert (
        error([str(tmp_path / "empty"), "--out", out])
        == f"armor-plot: error: no metrics in {tmp_path / 'empty' / 'metrics.jsonl'}"
    )
    assert (
        error([run, "--out", out, "--metric", "rollout/acuracy"])
        == "armor-plot: error: unknown --metric rollout/acuracy: no run logged it"
    )
    assert error([run, "--out", str(tmp_path / "x.pdf")]).startswith("armor-plot: error: --out must name a .png file")
    assert error([run, "--out", str(tmp_path / "no" / "x.png")]).startswith("armor-plot: error: --out directory")
    with pytest.raises(SystemExit) as exit_info:  # argparse exits by itself
        main([run])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "armor-plot: error: the following arguments are required: --out (see --help)\n"
    assert not (tmp_path / "x.png").exists()


def test_a_bug_while_reading_a_run_keeps_its_traceback(tmp_path, monkeypatch):
    """Only input errors are exit 2 and one line; a ValueError from inside the package is a bug."""
    from armor_megatron.trainer import plotting

    run = _write_run(tmp_path / "run", 0.01)

    def broken(path):
        raise ValueError("an internal check failed")

    monkeypatch.setattr(plotting, "read_metrics", broken)
    with pytest.raises(ValueError, match="an internal check failed"):
        main([run, "--out", str(tmp_path / "x.png")])


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    run = _write_run(tmp_path / "run", 0.01)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main([run, "--out", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == NEEDS_MATPLOTLIB + "\n"
    assert NEEDS_MATPLOTLIB == "armor-plot needs matplotlib (pip install 'armor_megatron[plot]')"
