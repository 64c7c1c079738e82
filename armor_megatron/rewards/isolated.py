"""Run a function in a separate, killable Python process under a hard wall-clock timeout.

Why a process: math-verify's own timeout is ``signal.alarm``, which (a) raises ValueError
off the main thread (reward workers, Ray actors, thread pools) and (b) cannot interrupt a
long C call such as a big-integer power ``9^{9^{9^9}}``, since Python handles signals only
between bytecodes. A worker process can always be killed. Workers are started with
``subprocess`` (not ``multiprocessing``), so they can also be started from inside daemonic
multiprocessing workers, and they outlive nothing: each exits when its stdin closes.

Protocol, over the worker's stdin/stdout pipes: 8-byte big-endian length + pickle of
``(kind, payload)``; kinds ``import`` (load a module before the clock starts) and ``call``
(``("module:function", args, kwargs)``), the module's import after the directories of ``reward.python_path``
are added to the worker's ``sys.path``; replies ``("ok", value)`` or ``("error", "Type: message")``.

Workers are pooled (at most ``max_workers``, started on demand, reused) and thread-safe:
each call checks one worker out. A worker whose call times out or that dies is killed and
replaced at once: a background thread starts a fresh one with the same modules imported
(seconds for math-verify), while the failed call returns within its timeout. A later call
that needs that slot waits for the replacement before its clock starts, so its timeout
measures its own work only. After ``os.fork`` the child gets a fresh, empty pool.

Stopping: :func:`interrupt_calls` (safe in a signal handler) stops every call in flight at once,
killing its worker, and refuses new calls with :class:`CallsInterrupted` until
:func:`allow_calls`; the trainer's preemption handler calls it, so a step stuck in a verifier ends
within a moment of SIGTERM. A reply larger than ``MAX_REPLY_BYTES`` kills its worker too
(:class:`ReplyTooLarge`): a verifier's output is capped as its memory is.

Preemption: workers start with SIGTERM and SIGUSR1 blocked (a signal mask survives exec), so a
signal to the trainer's whole process group, as SLURM sends it, does not kill them under a
trainer that is finishing its step and checkpoint; they still exit when their stdin closes.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from armor_megatron.rewards.spec import search_paths

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
STARTUP_TIMEOUT_S = 120.0
"""Seconds a new worker (or a module import in it) may take before it counts as broken."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # the trainer's; workers must not die of them


MAX_REPLY_BYTES = 64 << 20
"""The largest reply (pickled result) a worker may send; a larger one kills it."""


class IsolatedTimeout(TimeoutError):
    """The call did not finish within its timeout; its worker was killed."""


class CallsInterrupted(RuntimeError):
    """Calls were stopped by :func:`interrupt_calls` (a preemption signal); the worker was killed."""


class IsolatedCallError(RuntimeError):
    """The function raised inside the worker (message ``Type: text``), or the worker died."""


class UnpicklableArguments(TypeError):
    """The call's arguments do not pickle, so they cannot reach a worker (nothing was sent)."""


class WorkerDied(IsolatedCallError):
    """The worker process died during the call (killed by the OS, crashed)."""


class ReplyTooLarge(WorkerDied):
    """The worker's reply exceeded ``MAX_REPLY_BYTES``; the worker was killed."""


class _Interrupt:
    """The process-wide stop of :func:`interrupt_calls`: a flag and a pipe every waiting call polls."""

    def __init__(self) -> None:
        self.set = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)

    def trigger(self) -> None:
        self.set = True
        try:
            os.write(self.write_fd, b"x")  # wakes every poll; the byte stays until `clear`
        except BlockingIOError:
            pass  # already full of wake-ups

    def clear(self) -> None:
        self.set = False
        os.set_blocking(self.read_fd, False)
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        os.set_blocking(self.read_fd, True)

    def check(self) -> None:
        if self.set:
            raise CallsInterrupted("reward calls were stopped (a preemption signal)")


_INTERRUPT = _Interrupt()


class _Worker:
    """One worker process and the modules it has imported."""

    def __init__(self, memory_limit_mb: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)  # inherited by the worker
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "armor_megatron.rewards._worker", str(memory_limit_mb)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are PIPEs
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.imported: set[str] = set()
        try:
            self._receive(time.monotonic() + STARTUP_TIMEOUT_S)  # the worker's "ready"
        except BaseException:
            self.kill()
            raise

    def call(self, target: str, args: tuple[Any, ...], timeout_s: float, kwargs: Mapping[str, Any]) -> Any:
        """``target(*args, **kwargs)`` in this worker (``target``'s module imported first)."""
        self.preload(target.split(":", 1)[0])
        return self._request(("call", (target, args, dict(kwargs))), timeout_s)

    def preload(self, module: str) -> None:
        """Import ``module`` in the worker (once), under the start-up timeout."""
        if module not in self.imported:
            self._request(("import", (module, search_paths())), STARTUP_TIMEOUT_S)
            self.imported.add(module)

    def _request(self, message: tuple[Any, ...], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise UnpicklableArguments(f"{type(exc).__name__}: {exc}") from None
        try:
            self.stdin.write(_HEADER.pack(len(data)) + data)
            self.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"reward worker process died ({exc})") from None
        status, value = self._receive(deadline)
        if status == "error":
            raise IsolatedCallError(value)
        return value

    def _receive(self, deadline: float) -> tuple[str, Any]:
        (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))
        if size > MAX_REPLY_BYTES:
            raise ReplyTooLarge(f"reward worker's reply of {size} bytes exceeds {MAX_REPLY_BYTES} (MAX_REPLY_BYTES)")
        reply: tuple[str, Any] = pickle.loads(self._read_exact(size, deadline))
        return reply

    def _read_exact(self, size: int, deadline: float) -> bytes:
        fd = self.stdout.fileno()
        poller = select.poll()  # not select.select: trainers hold fds above FD_SETSIZE (1024)
        poller.register(fd, select.POLLIN)
        poller.register(_INTERRUPT.read_fd, select.POLLIN)
        chunks, remaining = [], size
        while remaining:
            _INTERRUPT.check()
            left = deadline - time.monotonic()
            ready = poller.poll(max(1, int(left * 1000))) if left > 0 else []
            _INTERRUPT.check()
            if not any(ready_fd == fd for ready_fd, _ in ready):
                if time.monotonic() < deadline:
                    continue  # a spurious wake-up
                raise IsolatedTimeout("reward worker did not answer in time")
            chunk = os.read(fd, remaining)
            if not chunk:
                try:
                    code = self.proc.wait(timeout=5)  # it closed stdout: it is exiting
                except subprocess.TimeoutExpired:
                    code = None
                raise WorkerDied(f"reward worker process died (exit code {code})")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """Thread-safe pool of at most ``max_workers`` worker processes, started on demand.

    ``memory_limit_mb`` caps each worker's address space (``RLIMIT_AS``) so that an answer
    that makes sympy build a gigantic number fails with MemoryError instead of eating the
    node's memory; 0 disables the cap.
    """

    def __init__(self, max_workers: int, memory_limit_mb: int = 4096) -> None:
        if max_workers < 1:
            raise ValueError(f"WorkerPool max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.memory_limit_mb = memory_limit_mb
        self._idle: list[_Worker] = []
        self._started = 0
        self._replacing: set[threading.Thread] = set()  # replacements of killed workers, still starting
        self._cond = threading.Condition()

    def run(self, target: str, args: tuple[Any, ...], timeout_s: float, kwargs: Mapping[str, Any] | None = None) -> Any:
        """Run ``target(*args, **kwargs)`` in a worker process under a timeout.

        IsolatedTimeout after ``timeout_s`` seconds of work (worker start-up and module import are
        not counted).
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        worker = self._acquire()
        try:
            result = worker.call(target, args, timeout_s, kwargs or {})
        except CallsInterrupted:  # stopping: kill it, start none in its place
            worker.kill()
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise
        except (IsolatedTimeout, WorkerDied):
            worker.kill()
            replacement = threading.Thread(
                target=self._replace, args=(worker.imported,), name="reward-worker-replace", daemon=True
            )
            with self._cond:
                self._replacing.add(replacement)
            replacement.start()
            raise
        except BaseException:
            self._release(worker)
            raise
        self._release(worker)
        return result

    def shutdown(self) -> None:
        """Stop all idle workers.

        Busy ones stop when their call returns and they are released),
        after the replacements still starting have joined them (else they would outlive this).
        """
        with self._cond:
            starting = list(self._replacing)
        for thread in starting:
            thread.join()
        with self._cond:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    def _acquire(self) -> _Worker:
        _INTERRUPT.check()
        with self._cond:
            while True:
                while not self._idle and self._started >= self.max_workers:
                    self._cond.wait(0.5)  # and look at the interrupt flag (set in a signal handler)
                    _INTERRUPT.check()
                if not self._idle:
                    self._started += 1
                    break
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                self._started -= 1  # died while idle (e.g. the OOM killer): replace it
                worker.close_pipes()
        try:
            return _Worker(self.memory_limit_mb)
        except BaseException as exc:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            if isinstance(exc, (IsolatedTimeout, WorkerDied)) and not isinstance(exc, ReplyTooLarge):
                raise IsolatedCallError(f"reward worker failed to start: {exc}") from None
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, modules: set[str]) -> None:
        """Start a worker with ``modules`` imported into the slot of a killed one.

        If that fails, free the slot (the next call starts a worker on demand).
        """
        try:
            self._start_replacement(modules)
        finally:
            with self._cond:
                self._replacing.discard(threading.current_thread())

    def _start_replacement(self, modules: set[str]) -> None:
        try:
            fresh = _Worker(self.memory_limit_mb)
            try:
                for module in sorted(modules):
                    fresh.preload(module)
            except BaseException:
                fresh.kill()
                raise
        except BaseException as exc:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            if not isinstance(exc, Exception):
                raise
            logger.warning("reward worker could not be replaced after a failed call: %s", exc)
            return
        self._release(fresh)

    def _forget_after_fork(self) -> None:
        # In a forked child the workers belong to the parent: drop our copies of the pipes
        # without signalling the processes, and start afresh.
        for worker in self._idle:
            worker.close_pipes()
        self._idle = []
        self._started = 0
        self._replacing = set()
        self._cond = threading.Condition()


def interrupt_calls() -> None:
    """Stop every call in flight (its worker killed) and refuse new ones, until :func:`allow_calls`.

    Safe to call from a signal handler: it sets a flag and writes one byte to a pipe.
    """
    _INTERRUPT.trigger()


def calls_interrupted() -> bool:
    """Whether :func:`interrupt_calls` stopped the calls (and :func:`allow_calls` has not undone it)."""
    return _INTERRUPT.set


def allow_calls() -> None:
    """Undo :func:`interrupt_calls`."""
    _INTERRUPT.clear()


def default_workers() -> int:
    """CPUs this process may run on (the SLURM/cgroup allotment, not the node's), at most 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus))


_POOL = WorkerPool(max_workers=default_workers())


def _after_fork_in_child() -> None:
    global _INTERRUPT
    _POOL._forget_after_fork()
    for fd in (_INTERRUPT.read_fd, _INTERRUPT.write_fd):
        os.close(fd)
    _INTERRUPT = _Interrupt()  # the parent's pipe would wake this process's calls (and its flag is not ours)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(lambda: _POOL.shutdown())


def run_isolated(target: str, *args: Any, timeout_s: float, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Call ``target`` (``"package.module:function"``) with picklable ``args`` and ``kwargs`` in the shared worker pool.

    Raise IsolatedTimeout if it runs longer than ``timeout_s`` seconds.
    """
    return _POOL.run(target, args, timeout_s, kwargs)


def configure_pool(max_workers: int | None = None, memory_limit_mb: int | None = None) -> None:
    """Resize the shared pool or change its memory cap (applies to workers started later)."""
    if max_workers is not None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        with _POOL._cond:
            _POOL.max_workers = max_workers
            _POOL._cond.notify_all()
    if memory_limit_mb is not None:
        _POOL.memory_limit_mb = memory_limit_mb


def shutdown_workers() -> None:
    """Stop the shared pool's idle workers (they restart on the next call)."""
    _POOL.shutdown()
