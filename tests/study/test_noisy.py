"""Provenance of the noisy-cue study's runs: done-markers record the commit and times, a run made
from the same things is not run again, and a study directory refuses runs of another commit."""

import json
import sys
import time

import pytest

from armor_megatron.study.noisy import _check_commit, provenance
from armor_megatron.study.runner import _run_all, _utc


def test_markers_record_provenance_and_a_finished_run_is_skipped(tmp_path):
    code = provenance()
    before = _utc(time.time() // 1)
    assert set(code) == {"commit", "dirty"} and len(code["commit"]) == 40 and isinstance(code["dirty"], bool)
    flag = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(flag)!r}, 'a').write('x')"]
    logs = []
    for _ in range(2):
        _run_all([("dapo", 101, cmd)], str(tmp_path), 1, {"models": {101: "m"}}, logs.append, provenance=code)
    assert flag.read_text() == "x" and logs[-1] == "dapo-s101: already done"  # the second call ran nothing
    marker = json.loads((tmp_path / "logs" / "dapo-s101.done").read_text())
    assert marker["command"] == cmd and marker["models"] == {"101": "m"}
    assert marker["provenance"]["commit"] == code["commit"] and marker["provenance"]["started"].endswith("Z")
    # UTC times of this test's own run (the strings order as the times do)
    assert before <= marker["provenance"]["started"] <= marker["provenance"]["ended"] <= _utc(time.time())


def test_runs_of_another_commit_are_refused_unless_mixing_is_allowed(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "dapo-s1.done").write_text(json.dumps({"provenance": {"commit": "a" * 40}}))
    _check_commit(str(tmp_path), {"commit": "a" * 40}, mix_commits=False)  # same commit: fine
    with pytest.raises(ValueError, match="run dapo-s1 came from commit a{40}, this code is b{40}"):
        _check_commit(str(tmp_path), {"commit": "b" * 40}, mix_commits=False)
    _check_commit(str(tmp_path), {"commit": "b" * 40}, mix_commits=True)
