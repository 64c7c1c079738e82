"""The whole loop through ``armor-train``: real processes (gloo ranks), the tiny model, the local
engine, Megatron actor and reference, checkpoints, resume and preemption. Runs that check the
command itself (exit codes, signals, the relaunch under torchrun) start it as a user does
(`_train_cli`); the others run its ranks on the suite's pooled processes (`_train`)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from armor_megatron.cli.train import processes_needed
from armor_megatron.config import load_config
from armor_megatron.trainer.metrics_log import read_metrics
from tests.megatron.spawn import run_ranks
from tests.processes import stopped_after

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # the `tiny` fixture (conftest) fills in its paths
PPO_CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _args(tiny, run_dir, *overrides, config=CONFIG):
    return [
        sys.executable,
        "-m",
        "armor_megatron.cli.train",
        "--config",
        config,
        *tiny,
        f"checkpoint.dir={run_dir}/ckpt",
        f"logging.dir={run_dir}/runs",
        "name=run",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "train.micro_batch_size=8",
        *overrides,
    ]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _metrics(run_dir):
    return {r["step"]: r for r in read_metrics(os.path.join(run_dir, "runs", "run", "metrics.jsonl"))}


def _train_cli(tiny, run_dir, *overrides, timeout=420, config=CONFIG):
    """``armor-train`` as a user starts it: a process of its own, which relaunches itself under
    torchrun when the layout needs more than one rank."""
    proc = subprocess.run(
        _args(tiny, run_dir, *overrides, config=config), env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _metrics(run_dir)


def _cli_rank(rank, argv, pythonpath):
    """One rank of ``armor-train ARGV`` (`cli.train.main`): a launcher set RANK, so it trains, no relaunch."""
    from armor_megatron.cli.train import main

    os.environ["PYTHONPATH"] = pythonpath  # user hooks (``module:function``) import from the repository
    return main(argv)


def _train(tiny, run_dir, *overrides, timeout=420, config=CONFIG):
    """``armor-train``'s ranks as torchrun starts them, on `tests.megatron.spawn.run_ranks`' pooled
    processes (a process start costs more than a tiny run's step); the run's metrics by step."""
    argv = _args(tiny, run_dir, *overrides, config=config)[3:]  # what follows ``python -m armor_megatron.cli.train``
    nprocs = processes_needed(load_config(config, argv[2:]))
    codes = run_ranks(_cli_rank, nprocs, argv, _env()["PYTHONPATH"], timeout=timeout)
    assert codes == [0] * nprocs, f"armor-train exit codes by rank: {codes} (their stderr: above)"
    return _metrics(run_dir)


def assert_anchors_found_and_trained_on(metrics, steps=(1, 2, 3)):
    """Every step trained on anchors and some of them carried a non-zero advantage into the loss
    (``anchor/zero_advantage_rate`` is logged only when the trained batch holds anchors), and π_ref
    found a rewarded response somewhere in the run. ``anchor/found_rate`` describes the first
    dynamic-sampling round only: a step may train on anchors of a later round while it reads 0."""
    for step in steps:
        assert metrics[step].get("anchor/zero_advantage_rate", 1.0) < 1.0, (step, metrics[step])
    assert max(metrics[step]["anchor/found_rate"] for step in steps) > 0.0


def _latest(run_dir):
    path = os.path.join(run_dir, "ckpt", "latest")
    return open(path).read().strip() if os.path.exists(path) else None


# tp2: anchors sampled afresh every step (no cache); pp2: the anchor cache, the next batch's anchors
# pre-generated in the background while the trainer updates, and token-budget micro-batches (rows packed, THD).
@pytest.mark.parametrize(
    "layout",
    [
        ["parallelism.tp=2", "anchor.cache=false"],
        [
            "parallelism.tp=1",
            "parallelism.pp=2",
            "anchor.cache=true",
            "anchor.pregenerate=true",
            "train.max_tokens_per_micro_batch=60",
        ],
    ],
    ids=["tp2", "pp2_packed"],
)
def test_a_few_steps_of_the_whole_loop(tiny, tmp_path, layout):
    train = _train_cli if "parallelism.tp=2" in layout else _train  # tp2: relaunched under torchrun, as users run it
    metrics = train(
        tiny, tmp_path, *layout, "train.steps=3", "eval.every_steps=3", "checkpoint.every_steps=0", "reference.tau=2"
    )
    assert sorted(metrics) == [0, 1, 2, 3]
    assert "eval/val/pass@1" in metrics[0] and "eval/val/pass@1" in metrics[3]
    for step in (1, 2, 3):
        m = metrics[step]
        assert m["train/skipped"] == 0.0 and m["train/num_tokens"] > 0
        # the engine sampled with exactly the trainer's weights (weight sync after every step)
        assert m["rollout/logprob_abs_diff"] < 1e-5
        # dynamic sampling (on by default): every kept group has signal, the batch came from >= 1 round
        assert m["dynamic_sampling/rounds"] >= 1 and m["dynamic_sampling/groups_seen"] >= 8
        assert m["dynamic_sampling/keep_rate"] > 0.0 and "train/skipped_no_signal" not in m
        # π_ref's tokens since the last step include this step's misses (and pre-generated anchors)
        assert m["anchor/reference_tokens"] >= m["anchor/generated_tokens"] and m["anchor/generation_cost"] >= 1.0
    assert_anchors_found_and_trained_on(metrics)
    assert metrics[2]["reference/reset"] == 1.0 and "reference/reset" not in metrics[3]
    # π_ref = π_θ at the first step and again right after the reset at step 2; it has drifted at step 2
    kl = {step: metrics[step]["train/approx_kl_ref"] for step in (1, 2, 3)}
    assert kl[1] < 1e-9 and kl[2] > 1e-6 and kl[3] < 1e-9, kl
    assert _latest(tmp_path) == "iter_0000003"
    if "anchor.cache=false" in layout:
        assert all(metrics[step]["anchor/cached_rate"] == 0.0 for step in (1, 2, 3))
    else:
        assert metrics[3]["anchor_cache/hit_rate"] > 0  # pre-generated anchors served from the pools


def _kill_9_at_checkpoint(args, run_dir, iteration: str) -> list[psutil.Process]:
    """Start ``armor-train`` (``args``) in a session of its own, ``kill -9`` its process group as soon as
    ``iteration`` is the latest checkpoint, and check that every rank it started died with it (torchrun
    puts ranks in sessions of their own: none may train on beside a resumed run). Returns the ranks."""
    proc = subprocess.Popen(
        args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while _latest(run_dir) != iteration:
            assert proc.poll() is None and time.time() < deadline, f"run ended before its checkpoint {iteration}"
            time.sleep(0.05)
        ranks = psutil.Process(proc.pid).children(recursive=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, [p.pid for p in alive]
    return ranks


def test_kill_9_then_resume_auto_reaches_the_uninterrupted_metrics(tiny, tmp_path):
    common = ["train.steps=4", "checkpoint.every_steps=2", "eval.every_steps=2"]
    reference = _train(tiny, tmp_path / "straight", *common)

    run = tmp_path / "killed"
    assert _kill_9_at_checkpoint(_args(tiny, run, *common), run, "iter_0000002")  # ranks under torchrun
    # checkpoint.resume defaults to auto; the trainer's memory goes to the host around every
    # rollout and evaluation (what colocated engines get) and must come back bit for bit
    resumed = _train(tiny, run, *common, "train.offload_during_rollout=true")
    assert sorted(resumed) == [0, 1, 2, 3, 4]  # records of the killed step 3 were dropped and rewritten
    for step in (3, 4):
        for key in ("rollout/accuracy", "train/loss", "train/grad_norm", "anchor/found_rate"):
            assert resumed[step][key] == reference[step][key], (step, key)
    assert resumed[4]["eval/val/pass@1"] == reference[4]["eval/val/pass@1"]

    # recovery mode: a fresh run whose reference starts from that (trained) checkpoint, not the policy
    recovered = _train(
        tiny,
        tmp_path / "recovery",
        "train.steps=1",
        "eval.every_steps=0",
        f"reference.init_from={tmp_path / 'straight' / 'ckpt' / 'iter_0000004'}",
    )
    assert recovered[1]["train/approx_kl_ref"] > 1e-6 and reference[1]["train/approx_kl_ref"] < 1e-9


@pytest.mark.parametrize("signum", [signal.SIGUSR1], ids=["SIGUSR1"])
def test_preemption_signal_checkpoints_and_exits_with_the_requeue_code(tiny, tmp_path, signum):
    # one process (tp=1), as srun starts every task: the signal reaches the trainer itself, which
    # saves a checkpoint for it (checkpoint.every_steps=0 saves none otherwise). SLURM sends SIGUSR1
    # ahead of the time limit (--signal=B:USR1@...); SIGTERM, on preemption, is the same handler's
    # (test_preemption.py sends it to a one-process task's group and checks this line too).
    proc = subprocess.Popen(
        _args(tiny, tmp_path, "parallelism.tp=1", "train.steps=200", "checkpoint.every_steps=0", "eval.every_steps=0"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    with stopped_after(proc):
        deadline = time.time() + 300
        while not (metrics.exists() and read_metrics(str(metrics))):
            assert proc.poll() is None and time.time() < deadline, (
                proc.stderr.read() if proc.poll() is not None else "slow"
            )
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 85, err[-2000:]
    # between steps, or during a rollout, whose reward calls the signal stops (the step does not train)
    assert f"preempted: {signum.name} at step" in err or f"preempted: {signum.name} during step" in err, err[-2000:]
    step = max(r["step"] for r in read_metrics(str(metrics)))
    assert _latest(tmp_path) == f"iter_{step:07d}"
    assert 0 < step < 200  # stopped by the signal, long before the configured 200 steps


@pytest.mark.parametrize("tp", [1, 2], ids=["one-process", "relaunched-tp2"])
def test_ctrl_c_stops_in_one_line_with_exit_130_and_keeps_the_last_checkpoint(tiny, tmp_path, tp):
    # Ctrl-C reaches the foreground process: the trainer itself, or the relaunching agent (tp=2)
    proc = subprocess.Popen(
        _args(
            tiny, tmp_path, f"parallelism.tp={tp}", "train.steps=200", "checkpoint.every_steps=1", "eval.every_steps=0"
        ),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a terminal's foreground process: SIGINT not ignored, even where this test runs as a background job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    with stopped_after(proc):
        deadline = time.time() + 300
        while not (tmp_path / "ckpt" / "latest").exists():
            assert proc.poll() is None and time.time() < deadline, (
                proc.stderr.read() if proc.poll() is not None else "slow"
            )
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.splitlines()[-1].startswith("armor-train: error: interrupted by SIGINT: stopped without a checkpoint")
    assert "Traceback" not in err, err[-2000:]
    assert _latest(tmp_path).startswith("iter_")


def test_ppo_with_a_critic_trains_and_resumes_the_critic(tiny, tmp_path):
    """configs/tiny_cpu_ppo.yaml at TP=2: GAE from a Megatron critic; step 1 is the critic's warm-up
    (no actor update), step 2 trains both. A run stopped after step 2 and resumed with
    ``--resume auto`` repeats step 3 of an uninterrupted run exactly, the critic included."""
    common = ["parallelism.tp=2", "eval.every_steps=0", "checkpoint.every_steps=2"]
    straight = _train(tiny, tmp_path / "straight", *common, "train.steps=3", config=PPO_CONFIG)
    assert sorted(straight) == [1, 2, 3]
    first, second = straight[1], straight[2]
    assert "train/loss" not in first and first["critic/skipped"] == 0.0  # warm-up: only the critic trained
    assert second["train/skipped"] == 0.0 and second["train/num_tokens"] > 0
    for step in (1, 2, 3):
        m = straight[step]
        assert m["critic/num_tokens"] > 0 and m["critic/grad_norm"] > 0 and "critic/value_clip_frac" in m
        assert "critic/explained_var" in m and "critic/old_explained_var" in m
        assert m["rollout/logprob_abs_diff"] < 1e-5
    # the zero-initialised head predicts V = 0 at step 1; its first update moves it
    assert first["critic/value_mean"] == 0.0 and second["critic/value_mean"] != 0.0

    run = tmp_path / "resumed"
    _train(tiny, run, *common, "train.steps=2", config=PPO_CONFIG)
    assert _latest(run) == "iter_0000002"
    resumed = _train(tiny, run, *common, "train.steps=3", "train.offload_during_rollout=true", config=PPO_CONFIG)
    for key in (
        "rollout/accuracy",
        "train/loss",
        "train/grad_norm",
        "critic/loss",
        "critic/grad_norm",
        "critic/value_mean",
        "critic/old_explained_var",
    ):
        assert resumed[3][key] == straight[3][key], key
