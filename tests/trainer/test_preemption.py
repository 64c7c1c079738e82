import os
import signal
import subprocess
import time

import pytest

from armor_megatron.trainer.metrics_log import read_metrics
from armor_megatron.trainer.preemption import PreemptionHandler
from tests.trainer.test_end_to_end import _args, _env, _latest, _train, _train_cli


def test_signals_are_recorded_not_fatal_and_handlers_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler() as handler:
        assert not handler.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.requested() and handler.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGUSR1) is before


def test_the_signal_stops_the_reward_calls_at_once():
    from armor_megatron.rewards.isolated import (
        CallsInterrupted,
        allow_calls,
        calls_interrupted,
        interrupt_calls,
        run_isolated,
    )

    try:
        with PreemptionHandler(on_signal=interrupt_calls):
            assert run_isolated("operator:add", 2, 3, timeout_s=60) == 5
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls_interrupted()
            with pytest.raises(CallsInterrupted):
                run_isolated("operator:add", 2, 3, timeout_s=60)
    finally:
        allow_calls()
    assert run_isolated("operator:add", 2, 3, timeout_s=60) == 5


# ----------------------------------------------------------------------------- whole runs (armor-train)
def _descendants(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout, delivery",
    [("tp1", "group"), ("tp2", "group"), ("tp2", "ranks"), ("tp2", "parent")],
    ids=["srun-task-group", "relaunch-group", "relaunch-ranks", "relaunch-parent"],
)
def test_preemption_checkpoints_exits_85_and_leaves_no_process(tiny, tmp_path, layout, delivery):
    """SIGTERM as SLURM delivers it: to the process group of a task (helpers included: checkpoint
    writers, reward workers), to the ranks only, or to the relaunching ``armor-train`` only. The
    run checkpoints (saving every step, so a signal may land mid-save), exits with the requeue
    code, leaves no process behind, and the requeued run resumes bit-exactly."""
    import psutil

    common = [f"parallelism.tp={layout[-1]}", "train.steps=5", "checkpoint.every_steps=1", "eval.every_steps=0"]
    proc = subprocess.Popen(
        _args(tiny, tmp_path / "preempted", *common),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "preempted" / "runs" / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 400
        while not (metrics.exists() and read_metrics(str(metrics))):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first step"
            time.sleep(0.05)
        everyone = _descendants(proc.pid)
        ranks = [p for p in everyone if "armor_megatron.cli.train" in " ".join(p.cmdline())]
        if delivery == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        elif delivery == "ranks":
            assert len(ranks) == 2
            for rank in ranks:
                rank.send_signal(signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 85, err[-3000:]
    assert err.count("preempted") == 1, err[-3000:]  # said once, not per rank
    if layout == "tp1":  # between steps, or during a rollout, whose reward calls the signal stops
        assert "preempted: SIGTERM at step" in err or "preempted: SIGTERM during step" in err, err[-3000:]
    _, alive = psutil.wait_procs(everyone, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "processes left behind"
    step = max(r["step"] for r in read_metrics(str(metrics)))
    assert 0 < step < 5 and _latest(tmp_path / "preempted") == f"iter_{step:07d}"
    assert not [n for n in os.listdir(tmp_path / "preempted" / "ckpt") if ".tmp-" in n]

    if (layout, delivery) == ("tp1", "group"):  # the requeued job continues exactly where it stopped
        resumed = _train(tiny, tmp_path / "preempted", *common)
        straight = _train(tiny, tmp_path / "straight", *common)
        assert sorted(resumed) == [1, 2, 3, 4, 5]
        for s in range(step + 1, 6):
            for key in ("rollout/accuracy", "train/loss", "train/grad_norm"):
                assert resumed[s][key] == straight[s][key], (s, key)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_during_a_step_stuck_in_a_verifier_saves_and_exits_85(tiny, tmp_path):
    """A user verifier that never returns (reward.timeout_s: an hour) holds step 1's rollout; SIGTERM
    to the task's process group, as SLURM sends it, stops its calls at once: the run saves the state
    it last completed (step 0: nothing was trained) and exits with the requeue code, well inside
    SLURM's grace period. The requeued run, whose verifier answers, resumes from that checkpoint."""
    marker = tmp_path / "verifier-called"
    common = [
        "parallelism.tp=1",
        "train.steps=1",
        "checkpoint.every_steps=0",
        "eval.every_steps=0",
        "reward.verifier=tests.trainer.user_hooks:hangs_once_marked",
        "data.type_key=no_such_column",  # every row by reward.verifier
        "reward.timeout_s=3600",
    ]
    proc = subprocess.Popen(
        _args(tiny, tmp_path, *common),
        env={**_env(), "ARMOR_TEST_HANG_MARKER": str(marker)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 400
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before scoring"
            time.sleep(0.05)
        time.sleep(1.0)  # stuck for good now
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)  # SLURM's grace: before this fix it waited for SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 85, err[-3000:]
    assert "preempted: SIGTERM during step 1, which stopped its reward calls and did not train" in err, err[-3000:]
    assert "checkpoint of step 0 saved" in err
    assert _latest(tmp_path) == "iter_0000000"
    resumed = _train_cli(tiny, tmp_path, *common)  # without the marker variable: the verifier answers
    assert sorted(resumed) == [1] and "rollout/accuracy" in resumed[1]
