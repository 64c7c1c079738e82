import io
import math

import pytest
import torch

from armor_megatron.trainer.metrics_log import (
    MetricsLogger,
    StepReporter,
    read_metrics,
    step_line,
    wandb_run_id,
)


def test_jsonl_records_scalars_and_survives_resume(tmp_path):
    log = MetricsLogger(str(tmp_path))
    for step in range(1, 5):
        log.log(step, {"reward": step / 10, "t": torch.tensor(2.0), "skip": True, "name": "ignored", "bad": math.inf})
    log.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["reward"] == 0.1 and records[0]["t"] == 2.0 and records[0]["skip"] == 1.0
    assert "name" not in records[0] and records[0]["bad"] == "inf"
    # resuming from the checkpoint of step 2 drops the records the resumed run will write again
    log = MetricsLogger(str(tmp_path), resume_step=2)
    assert not log.lacks(2) and log.lacks(3)  # the log kept step 2's record
    log.log(3, {"reward": 0.33})
    log.close()
    assert [(r["step"], r["reward"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.33),
    ]


def test_a_resumed_log_tells_which_steps_it_lacks(tmp_path):
    log = MetricsLogger(str(tmp_path))
    log.log(0, {"eval/x": 1.0})
    log.log(1, {"reward": 0.1})
    log.close()
    # killed after the checkpoint of step 2 and before its record: the log ends at step 1
    log = MetricsLogger(str(tmp_path), resume_step=2)
    assert log.lacks(2) and not log.lacks(1)
    log.log(2, {"reward": 0.2})
    assert not log.lacks(2)
    log.close()
    assert MetricsLogger(str(tmp_path / "fresh"), resume_step=2).lacks(2)  # no log at all
    assert not MetricsLogger(str(tmp_path / "off"), jsonl=False, resume_step=2).lacks(2)  # nothing to tell


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics(str(path)) == [{"step": 1, "x": 1.0}]


def test_nan_is_json_null(tmp_path):
    log = MetricsLogger(str(tmp_path))
    log.log(1, {"x": math.nan, "y": -math.inf})
    log.close()
    assert '"x": null' in (tmp_path / "metrics.jsonl").read_text()
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["y"] == "-inf"


def test_the_wandb_run_id_survives_a_requeue(tmp_path):
    first = wandb_run_id(str(tmp_path))
    assert wandb_run_id(str(tmp_path)) == first and len(first) == 16


def _steps(every_steps, evals_every, total=6):
    """Metrics of ``total`` steps with an evaluation every ``evals_every`` steps."""
    for step in range(1, total + 1):
        m = {"rollout/reward": 0.5, "time/step": 1.0}
        if step % evals_every == 0:
            m["eval/mean/pass@1"] = 0.25
        yield step, m


def test_logging_every_steps_never_drops_an_evaluation(tmp_path):
    log = MetricsLogger(str(tmp_path))
    reporter = StepReporter(log, every_steps=3, total_steps=6, progress_bar=False, stream=io.StringIO())
    for step, m in _steps(3, 2):
        reporter.report(step, m)
    log.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    assert [r["step"] for r in records if "eval/mean/pass@1" in r] == [2, 4, 6]


@pytest.mark.parametrize("progress_bar", [True, False])
def test_one_plain_line_per_step_off_a_terminal(progress_bar):
    out = io.StringIO()  # a SLURM .out file: not a TTY
    reporter = StepReporter(None, every_steps=1, total_steps=6, progress_bar=progress_bar, stream=out)
    for step, m in _steps(1, 2):
        reporter.report(step, m)
    reporter.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and "\r" not in out.getvalue()
    assert lines[0] == "[armor] step 1/6 | reward 0.500 | 1.00 s/step"
    assert "val 0.250" in lines[1] and "val" not in lines[2]


def test_each_line_starts_with_the_runs_name():
    """A DAPO baseline beside an ARMOR run: their interleaved lines say which run they belong to."""
    out = io.StringIO()
    reporter = StepReporter(None, every_steps=1, total_steps=6, name="dapo-s1", progress_bar=False, stream=out)
    reporter.report(*next(iter(_steps(1, 2))))
    assert out.getvalue().startswith("[dapo-s1] step 1/6 | reward 0.500")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_the_bar_and_no_lines():
    out = _Terminal()
    reporter = StepReporter(None, every_steps=1, total_steps=2, progress_bar=True, stream=out)
    for step, m in _steps(1, 2, total=2):
        reporter.report(step, m)
    reporter.close()
    assert "[armor] step" not in out.getvalue() and "2/2" in out.getvalue()


def test_the_step_line_shows_phases_throughput_and_namespaces_dynamic_sampling(tmp_path):
    metrics = {
        "rollout/reward": 0.25,
        "rollout/accuracy": 0.5,
        "rollout/response_len": 6.25,
        "rollout/response_len_max": 8.0,
        "rollout/truncated_rate": 0.125,
        "time/rollout": 1.5,
        "time/update": 0.25,
        "perf/tokens_per_s": 123.4,
        "time/step": 2.0,
        "dynamic_sampling/rounds": 2.0,
    }
    assert step_line(3, 20, metrics) == (
        "step 3/20 | reward 0.250 | acc 0.500 | len 6.250 | len_max 8.000 | trunc 0.125 | "
        "rollout 1.50s update 0.25s | 123 tok/s | 2.00 s/step"
    )
    log = MetricsLogger(str(tmp_path))
    logged = StepReporter(log, every_steps=1, total_steps=20, progress_bar=False, stream=io.StringIO()).report(
        3, metrics
    )
    log.close()
    assert logged["dynamic_sampling/rounds"] == 2.0
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["dynamic_sampling/rounds"] == 2.0


def test_a_fresh_start_moves_an_earlier_runs_metrics_aside(tmp_path):
    log = MetricsLogger(str(tmp_path))
    log.log(1, {"reward": 0.5})
    log.close()
    log = MetricsLogger(str(tmp_path), fresh_start=True)
    log.log(1, {"reward": 0.9})
    log.close()
    assert [r["reward"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0.9]
    assert [r["reward"] for r in read_metrics(log.set_aside)] == [0.5]  # nothing lost
    assert MetricsLogger(str(tmp_path / "new"), fresh_start=True).set_aside is None


def _skipped(accuracy: float) -> dict:
    """A step that trained nothing, as the loop reports it: no tokens, so 0 tok/s."""
    return {
        "rollout/reward": accuracy,
        "rollout/accuracy": accuracy,
        "train/skipped_no_signal": 1.0,
        "time/rollout": 1.0,
        "perf/tokens_per_s": 0.0,
        "time/step": 1.5,
    }


def test_a_skipped_step_says_so_on_its_line_instead_of_0_tokens_per_s():
    assert step_line(4, 20, _skipped(0.0)) == (
        "step 4/20 | reward 0.000 | acc 0.000 | skipped: every group scored alike | rollout 1.00s | 1.50 s/step"
    )


def test_skipped_steps_in_a_row_warn_once_and_again_after_a_step_trains():
    from armor_megatron.trainer.metrics_log import SKIPPED_IN_A_ROW_WARNING as N

    out = io.StringIO()
    reporter = StepReporter(None, every_steps=1, total_steps=40, progress_bar=False, stream=out)
    trained = {"rollout/reward": 0.5, "time/step": 1.0}
    steps = [_skipped(0.0)] * (N - 1) + [trained] + [_skipped(0.0)] * (2 * N)  # N-1 in a row say nothing
    steps += [trained] + [_skipped(1.0)] * N
    for step, m in enumerate(steps, 1):
        reporter.report(step, m)
    warnings = [line for line in out.getvalue().splitlines() if " warning: " in line]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"[armor] warning: {N} steps in a row skipped, every group scored alike")
    assert "(rollout/accuracy 0.000)" in warnings[0] and "(rollout/accuracy 1.000)" in warnings[1]
    assert "data.answer_key" in warnings[0] and "max_oversample_rounds" in warnings[0]
