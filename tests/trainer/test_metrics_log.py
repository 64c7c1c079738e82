import math

import torch

from armor_megatron.trainer.metrics_log import MetricsLogger, read_metrics


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
    log.log(3, {"reward": 0.33})
    log.close()
    assert [(r["step"], r["reward"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.33),
    ]


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics(str(path)) == [{"step": 1, "x": 1.0}]
