"""Run a function on N local ranks (spawned processes, gloo) with a hard timeout.

`run_ranks(fn, world_size, *args, timeout=...)` sets the torchrun variables for each rank,
calls ``fn(rank, *args)`` there and returns the per-rank results; a rank that raises, dies
or outlives the timeout fails the caller with its traceback.

Ranks are kept for the session: starting one (a Python process importing torch, megatron-core and
the test module) costs several seconds, more than most calls run, so a call hands its function to
ranks 0..N-1 of a pool of idle spawned processes and later calls reuse them. Each call still sees
what a fresh process would: the caller's environment and working directory, torch's start-up seed,
torch's intra-op threads as torchrun sets them (one per rank for several ranks), no process group
(the one a call leaves is destroyed after it, megatron-core's model-parallel groups too) and
deterministic algorithms off. A call in which a rank raised, died or timed out
retires the whole pool (the next call starts new processes), so nothing a failed call left half done
reaches another. ``fresh=True`` runs the call in processes of its own, for tests that measure
process-wide state (peak RSS) or change what they cannot restore. `stop_pool` ends the pool:
tests/conftest.py calls it at the end of the run, before it looks for leftover processes.

No port race: the parent hosts the rendezvous store itself, bound to port 0 and held for the
whole run, and the ranks join it as clients, exactly as under torchrun, whose agent hosts the
store and sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch.distributed then connects every rank,
rank 0 included, to ``MASTER_ADDR:MASTER_PORT`` instead of starting a server there). A port picked
free, released and bound again seconds later by a child can be taken in between by another test.
"""

import atexit
import datetime
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback

import psutil
import torch.distributed
import torch.multiprocessing as mp

HOST = "127.0.0.1"
_DEFAULT_THREADS = torch.get_num_threads()  # in a rank: before any call set it
STOP_S = 60.0  # a pooled rank asked to stop exits within this (it writes its coverage data on exit)


def rendezvous_store(timeout_s: float = 300.0) -> torch.distributed.TCPStore:
    """A TCPStore server on a port the OS picked (held until the store is dropped); children reach
    it through ``MASTER_PORT=store.port`` with ``TORCHELASTIC_USE_AGENT_STORE=True``."""
    return torch.distributed.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _rank_environ(rank, world_size, port):
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),  # one node, as torchrun sets it
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )


def _entry(fn, rank, world_size, port, out_dir, args):
    os.environ.update(_rank_environ(rank, world_size, port))
    # intra-op threads as a fresh process gets them: torchrun sets OMP_NUM_THREADS=1 for more than one
    # rank (N ranks of 2 threads each on 2 cores spin on each other), one process (srun's task) keeps
    # torch's default; torch read the variable when this process imported it, before the line above
    torch.set_num_threads(1 if world_size > 1 else _DEFAULT_THREADS)
    try:
        result = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _end_distributed() -> None:
    """Destroy what a call left: megatron-core's model-parallel groups and the default process group."""
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _serve(conn):
    """A pooled rank: run the calls sent over `conn` until told to stop (or the parent is gone)."""
    import torch

    start_seed = torch.initial_seed()
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            _stop_children()
            return
        if message == b"stop":
            _stop_children()
            return
        out_dir, rank = None, None
        try:
            job = pickle.loads(message)
            out_dir, rank, environ, cwd = job["out_dir"], job["rank"], job["environ"], job["cwd"]
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            torch.manual_seed(start_seed)
            torch.use_deterministic_algorithms(False)
            with open(os.path.join(out_dir, f"{rank}.log"), "wb") as log:
                saved = [os.dup(1), os.dup(2)]
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
                try:
                    _entry(job["fn"], rank, job["world_size"], job["port"], out_dir, job["args"])
                    _end_distributed()
                finally:
                    sys.stdout.flush(), sys.stderr.flush()
                    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                    os.close(saved[0]), os.close(saved[1])
        except BaseException:  # noqa: BLE001 - the job could not even start (unpickling, a bad cwd)
            if out_dir is not None and not os.path.exists(os.path.join(out_dir, f"{rank}.pkl")):
                with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
                    pickle.dump(("error", traceback.format_exc()), f)
        conn.send_bytes(b"done")


def _stop_children() -> None:
    """Kill what a pooled rank's calls left running (e.g. the ``multiprocessing`` manager megatron's
    checkpoint writer starts and keeps): orphaned, it would hold the session's resource-tracker pipe
    open and keep pytest waiting at exit."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


class _Pool:
    """Idle spawned ranks; rank r of every call runs in ``ranks[r]`` (grown on demand)."""

    def __init__(self):
        self.ranks = []  # (process, parent end of its pipe)
        # what the ranks' calls started and left running (megatron's checkpoint writer keeps a
        # multiprocessing manager), seen after every call: a rank that dies (a test may kill it)
        # orphans them, and stopping the pool ends them wherever they are by then
        self.started = {}

    def note_children(self, count):
        for proc, _ in self.ranks[:count]:
            for child in _descendants(proc.pid):
                self.started[child.pid] = child

    def grow(self, size):
        ctx = mp.get_context("spawn")
        while len(self.ranks) < size:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=False)
            proc.start()
            child.close()
            self.ranks.append((proc, parent))

    def stop(self):
        """Ask every rank to exit (a clean exit writes its coverage data), kill what does not."""
        for _, conn in self.ranks:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        deadline = time.monotonic() + STOP_S
        for proc, conn in self.ranks:
            left = _descendants(proc.pid)
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                left = _descendants(proc.pid) or left
                proc.kill()
                proc.join()
            for child in left:
                self.started[child.pid] = child
            conn.close()
        for child in self.started.values():  # psutil checks it is still the same process
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.ranks, self.started = [], {}


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


_pool = _Pool()
_lock = threading.Lock()


def stop_pool() -> None:
    """Stop the session's pooled ranks (idempotent)."""
    with _lock:
        _pool.stop()


atexit.register(stop_pool)  # runs before multiprocessing's own exit hook, which joins its children


def _collect(world_size, out_dir, status):
    """Per-rank results read from `out_dir`; `status[r]` says why rank r wrote none."""
    results, errors = [], []
    for r in range(world_size):
        path = os.path.join(out_dir, f"{r}.pkl")
        if not os.path.exists(path):
            errors.append(f"rank {r}: {status(r)}")
            continue
        with open(path, "rb") as f:
            state, value = pickle.load(f)
        if state == "error":
            errors.append(f"rank {r}:\n{value}")
        results.append(value)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _run_fresh(fn, world_size, args, timeout):
    ctx = mp.get_context("spawn")
    store = rendezvous_store(timeout)
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store.port, out_dir, args)) for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:  # also when the caller is interrupted (Ctrl-C, pytest-timeout) while it waits
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        del store  # the port is held until every rank is gone
        return _collect(
            world_size,
            out_dir,
            lambda r: "timed out" if r in alive else f"died with exit code {procs[r].exitcode}",
        )


def _run_pooled(fn, world_size, args, timeout):
    store = rendezvous_store(timeout)
    with tempfile.TemporaryDirectory() as out_dir:
        _pool.grow(world_size)
        ranks = _pool.ranks[:world_size]
        answered, timed_out = set(), set()
        try:
            environ, cwd = dict(os.environ), os.getcwd()
            for r, (_, conn) in enumerate(ranks):
                job = dict(fn=fn, rank=r, world_size=world_size, port=store.port, out_dir=out_dir, args=args)
                conn.send_bytes(pickle.dumps(dict(job, environ=environ, cwd=cwd)))
            deadline = time.monotonic() + timeout
            for r, (proc, conn) in enumerate(ranks):
                try:
                    if conn.poll(max(0.0, deadline - time.monotonic())):
                        if conn.recv_bytes() == b"done":
                            answered.add(r)
                    else:
                        timed_out.add(r)
                except (EOFError, OSError):
                    proc.join(5)  # it died: let its exit code be read
        finally:  # also when the caller is interrupted (Ctrl-C, pytest-timeout) while it waits
            _pool.note_children(world_size)
            for r, (proc, _) in enumerate(ranks):
                if r not in answered and proc.is_alive():
                    timed_out.add(r)
                    proc.kill()
                    proc.join()
            _copy_logs(out_dir, world_size)
            if len(answered) < world_size or _any_error(out_dir, world_size):
                _pool.stop()
        del store
        return _collect(
            world_size,
            out_dir,
            lambda r: "timed out" if r in timed_out else f"died with exit code {ranks[r][0].exitcode}",
        )


def _copy_logs(out_dir, world_size):
    """What the ranks printed, onto this process's stderr (where pytest captures a test's output)."""
    for r in range(world_size):
        path = os.path.join(out_dir, f"{r}.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text = f.read()
            if text:
                sys.stderr.write(f"--- rank {r} ---\n{text}")


def _any_error(out_dir, world_size):
    for r in range(world_size):
        path = os.path.join(out_dir, f"{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                if pickle.load(f)[0] == "error":
                    return True
    return False


def run_ranks(fn, world_size, *args, timeout=240, fresh=False):
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each on its own rank of a gloo job."""
    if fresh:
        return _run_fresh(fn, world_size, args, timeout)
    with _lock:
        return _run_pooled(fn, world_size, args, timeout)
