"""A study's figure is written atomically as a PNG, one line and band per variant."""

import math
import os

import pytest

from armor_megatron.tasks.study_stats import VariantCurves

pytest.importorskip("matplotlib")


def test_plot_study_writes_a_png_and_leaves_no_temporary_file(tmp_path):
    from armor_megatron.study.plots import plot_study

    def curves(name, seeds):
        sd = [math.nan] * 3 if seeds == 1 else [0.05, 0.04, 0.03]
        return VariantCurves(name, seeds, [0, 5, 10], [0.2, 0.3, 0.4], sd, [0.1, 0.2, 0.3], sd, resets=[5])

    out = tmp_path / "study.png"
    plot_study({"dapo": curves("dapo", 2), "armor": curves("armor", 1)}, {"armor": "ARMOR"}, str(out), title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["study.png"]
