"""The data behind ``armor-plot``'s panels, checked by value on hand-written records."""

import math

import pytest

from armor_megatron.errors import MetricsLogError, MissingInputError
from armor_megatron.trainer.metrics_log import MetricsLogger
from armor_megatron.trainer.plotting import OTHER, load_run, phase_timings, reset_steps, series, unique_labels

RECORDS = [
    # step 0: the evaluation before training logs only eval keys
    {"step": 0, "time": 0.0, "eval/mean/pass@1": 0.25},
    {
        "step": 2,
        "time": 2.0,
        "rollout/accuracy": 0.5,
        "time/rollout": 1.0,
        "time/update": 2.0,
        "time/step": 3.5,
        "reference/reset": 1.0,
    },
    {"step": 1, "time": 1.0, "rollout/accuracy": "nan", "time/rollout": 1.5, "time/step": 1.0},
]


def test_series_sorts_by_step_and_reads_nan_strings():
    steps, values = series(RECORDS, "rollout/accuracy")
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 0.5
    assert series(RECORDS, "eval/mean/pass@1") == ([0], [0.25])
    assert series(RECORDS, "absent") == ([], [])


def test_reset_steps():
    assert reset_steps(RECORDS) == [2]


def test_phase_timings_stack_to_step_time():
    steps, phases = phase_timings(RECORDS)
    # step 0 has no time/step; phases never logged (logprobs, eval, ...) are left out
    assert steps == [1, 2] and list(phases) == ["rollout", "update", OTHER]
    assert phases["rollout"] == [1.5, 1.0]
    assert phases["update"] == [0.0, 2.0]  # absent at step 1 -> 0
    # other = max(0, step - sum): step 1 phases (1.5 s) exceed its 1.0 s -> 0; step 2: 3.5 - 3.0
    assert phases[OTHER] == [0.0, 0.5]


def test_load_run_from_dir_or_file_and_labels(tmp_path):
    for parent in ("a", "b"):
        log = MetricsLogger(str(tmp_path / parent / "armor"))
        log.log(1, {"rollout/accuracy": 0.5})
        log.close()
    by_dir = load_run(str(tmp_path / "a" / "armor"))
    by_file = load_run(str(tmp_path / "b" / "armor" / "metrics.jsonl"))
    assert by_dir.label == by_file.label == "armor"
    assert by_dir.keys() == {"rollout/accuracy"}
    unique_labels([by_dir, by_file])
    assert (by_dir.label, by_file.label) == ("a/armor", "b/armor")


def test_load_run_rejects_missing_and_empty(tmp_path):
    with pytest.raises(MissingInputError, match="no such run directory or metrics file: .*nowhere"):
        load_run(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingInputError, match="no metrics file: .*empty/metrics.jsonl"):
        load_run(str(tmp_path / "empty"))
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(MetricsLogError, match="no metrics in"):
        load_run(str(tmp_path / "empty"))


def test_null_values_read_as_nan():
    """MetricsLogger writes NaN as JSON null."""
    records = [{"step": 1, "rollout/accuracy": None, "time/rollout": None, "time/step": 1.0}]
    steps, values = series(records, "rollout/accuracy")
    assert steps == [1] and math.isnan(values[0])
    assert phase_timings(records)[1]["rollout"] == [0.0]


def test_step_timeline_reads_the_bars_and_keeps_the_last_run_of_a_resumed_log():
    from armor_megatron.trainer.plotting import step_timeline

    def record(step, rollout, update):
        return {
            "step": step,
            "timeline/rollout_begin": rollout[0],
            "timeline/rollout_end": rollout[1],
            "timeline/update_begin": update[0],
            "timeline/update_end": update[1],
        }

    # one_step: step 2's batch was generated while step 1 updated
    records = [record(1, (0.0, 1.0), (1.0, 3.0)), record(2, (1.0, 2.5), (3.0, 5.0)), {"step": 0, "time": 0.0}]
    assert step_timeline(records) == [
        (1, {"rollout": (0.0, 1.0), "update": (1.0, 3.0)}),
        (2, {"rollout": (1.0, 2.5), "update": (3.0, 5.0)}),
    ]
    resumed = [*records, record(3, (0.5, 0.9), (1.0, 2.0))]  # the clock restarted at the resume
    assert [step for step, _ in step_timeline(resumed)] == [3]
    assert step_timeline([{"step": 1, "timeline/update_begin": 1.0}]) == []
