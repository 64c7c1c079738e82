import multiprocessing
import os
import resource
import select
import signal
import threading
import time

import psutil
import pytest

from armor_megatron.rewards import compute_score
from armor_megatron.rewards.isolated import IsolatedCallError, IsolatedTimeout, WorkerPool

T = "tests.rewards.worker_targets"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pool():
    pool = WorkerPool(max_workers=2, memory_limit_mb=1024)
    yield pool
    pool.shutdown()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_is_reused(pool):
    first = pool.run(f"{T}:pid", (), timeout_s=30)
    assert first != os.getpid()
    assert pool.run(f"{T}:pid", (), timeout_s=30) == first


def test_timeout_kills_the_worker_and_a_new_one_takes_over(pool):
    old = pool.run(f"{T}:pid", (), timeout_s=30)
    start = time.monotonic()
    with pytest.raises(IsolatedTimeout):
        pool.run(f"{T}:sleep_then_pid", (60,), timeout_s=0.5)
    assert time.monotonic() - start < 45  # not the target's 60 s: the timeout ended the call (any load)
    assert not _alive(old)
    assert pool.run(f"{T}:pid", (), timeout_s=30) != old


def test_exception_in_target_is_reported_and_worker_survives(pool):
    before = pool.run(f"{T}:pid", (), timeout_s=30)
    with pytest.raises(IsolatedCallError, match="^ValueError: boom$"):
        pool.run(f"{T}:boom", (), timeout_s=30)
    assert pool.run(f"{T}:pid", (), timeout_s=30) == before


def test_dead_worker_is_reported_and_replaced(pool):
    with pytest.raises(IsolatedCallError, match=r"died \(exit code 3\)"):
        pool.run(f"{T}:die", (), timeout_s=30)
    assert pool.run(f"{T}:pid", (), timeout_s=30) > 0


def test_worker_that_died_while_idle_is_replaced_silently(pool):
    old = pool.run(f"{T}:pid", (), timeout_s=30)
    _kill_and_wait(old)
    assert pool.run(f"{T}:pid", (), timeout_s=30) not in (old, os.getpid())


def _kill_and_wait(pid, wait_s=60):
    """SIGKILL ``pid`` and block until it has exited (its pidfd turns readable; no polling)."""
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        ready, _, _ = select.select([pidfd], [], [], wait_s)
        assert ready, f"process {pid} still alive {wait_s} s after SIGKILL"
    finally:
        os.close(pidfd)


def test_stray_prints_do_not_break_the_protocol(pool):
    assert pool.run(f"{T}:chatty", ({"a": [1, 2]},), timeout_s=30) == {"a": [1, 2]}


def test_unpicklable_result_and_bad_target(pool):
    with pytest.raises(IsolatedCallError, match="result is not picklable"):
        pool.run(f"{T}:unpicklable", (), timeout_s=30)
    with pytest.raises(IsolatedCallError, match="has no attribute 'nope'"):
        pool.run(f"{T}:nope", (), timeout_s=30)


def test_memory_cap_turns_huge_allocations_into_memory_error(pool):
    with pytest.raises(IsolatedCallError, match="^MemoryError"):
        pool.run(f"{T}:allocate", (2048,), timeout_s=30)  # 2 GiB > the 1 GiB cap
    assert pool.run(f"{T}:allocate", (16,), timeout_s=30) == 16 * 1024 * 1024


def _concurrent_pids(pool, n, marks):
    """``n`` threads call at once; each call waits inside its worker until two calls have started,
    so with two workers the first two calls overlap whatever the machine's load."""
    pids = []
    lock = threading.Lock()

    def call():
        pid = pool.run(f"{T}:rendezvous_then_pid", (str(marks), 2, 30.0), timeout_s=60)
        with lock:
            pids.append(pid)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return pids


def test_concurrent_callers_get_separate_workers_up_to_the_cap(pool, tmp_path):
    pool.run(f"{T}:pid", (), timeout_s=30)
    pids = _concurrent_pids(pool, 4, tmp_path)
    assert len(pids) == 4 and len(set(pids)) == 2  # max_workers=2: two processes shared by four threads


def test_works_when_the_caller_holds_more_than_1024_fds(pool):
    # large trainers hold thousands of sockets and files; select.select would fail above 1024
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"open-file limit {soft} is too low for this test")
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert pool.run(f"{T}:chatty", (7,), timeout_s=30) == 7
    finally:
        for fd in fds:
            os.close(fd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        WorkerPool(max_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        WorkerPool(max_workers=1).run(f"{T}:pid", (), timeout_s=0)


def _score_in_pool_worker(_):
    return compute_score(r"\boxed{\dfrac{2}{4}}", "0.5").score


@pytest.mark.slow
def test_math_reward_inside_a_daemonic_forked_pool_worker():
    # multiprocessing.Pool workers are daemonic (they may not start multiprocessing children)
    # and forked (they inherit this process's reward pool): both must be handled.
    compute_score(r"\boxed{1}", "2")  # the parent's shared pool now holds a live worker
    with multiprocessing.get_context("fork").Pool(1) as mp_pool:
        assert mp_pool.map(_score_in_pool_worker, [0], chunksize=1) == [1.0]
    assert compute_score(r"\boxed{1/2}", "0.5").score == 1.0  # the parent's worker is untouched


def test_worker_that_timed_out_is_replaced_at_once_with_its_modules(tmp_path, monkeypatch):
    slow = "tests.rewards.slow_import_target"  # not imported here: its import waits at the gate
    monkeypatch.setenv("ARMOR_TEST_IMPORT_GATE", str(tmp_path))  # workers inherit it: imports wait for tmp_path/open
    imports = tmp_path / "imports.log"
    pool = WorkerPool(max_workers=2, memory_limit_mb=1024)
    try:
        (tmp_path / "open").touch()
        old = pool.run(f"{slow}:pid", (), timeout_s=30)
        assert imports.read_text().split() == [str(old)]

        (tmp_path / "open").unlink()  # the replacement's import now blocks until the gate opens
        with pytest.raises(IsolatedTimeout):
            pool.run(f"{slow}:sleep_then_pid", (60,), timeout_s=0.5)
        # the failed call returned while its replacement is still importing: it did not wait for it
        assert imports.read_text().split() == [str(old)]

        (tmp_path / "open").touch()
        deadline = time.monotonic() + 120
        while not pool._idle and time.monotonic() < deadline:  # the replacement starts without any call
            time.sleep(0.05)
        assert pool._idle, "no replacement worker after 120 s"
        replacement = imports.read_text().split()[1]
        assert pool.run(f"{slow}:pid", (), timeout_s=30) == int(replacement) != old
        # the call found the module imported in the replacement: nobody imported it again
        assert imports.read_text().split() == [str(old), replacement]
    finally:
        pool.shutdown()


def _worker_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children() if "armor_megatron.rewards._worker" in " ".join(p.cmdline())}


def test_shutdown_also_stops_the_replacement_of_a_timed_out_worker():
    # the replacement starts in the background after the failed call; a shutdown meanwhile must
    # not let it join the pool afterwards, alive and owned by nobody
    before = _worker_pids()  # other pools' workers (the shared pool's, for one)
    pool = WorkerPool(max_workers=1, memory_limit_mb=1024)
    with pytest.raises(IsolatedTimeout):
        pool.run(f"{T}:sleep_then_pid", (60,), timeout_s=0.5)
    pool.shutdown()
    time.sleep(2)  # time for a replacement that was not waited for to come up
    assert not pool._idle and _worker_pids() <= before
