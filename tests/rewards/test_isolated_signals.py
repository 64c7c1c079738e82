"""Reward workers survive the preemption signals SLURM sends to the trainer's whole process group."""

import os
import signal

from armor_megatron.rewards.isolated import WorkerPool


def test_a_worker_outlives_sigterm_and_sigusr1_and_keeps_answering():
    pool = WorkerPool(max_workers=1)
    try:
        assert pool.run("operator:add", (2, 3), timeout_s=60) == 5
        (worker,) = pool._idle
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            os.kill(worker.proc.pid, sig)
        assert pool.run("operator:mul", (2, 3), timeout_s=60) == 6
        assert worker.proc.poll() is None and pool._idle == [worker]  # the same process, not a replacement
    finally:
        pool.shutdown()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the trainer's own mask is restored
