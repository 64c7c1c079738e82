"""Run one command as N local ranks under torchrun's agent, inside this process.

For ``armor-train`` started by hand for a multi-rank job.

Signals: torchrun's agent turns a SIGTERM into "terminate the workers, SIGKILL after 30 s",
which would cut a checkpoint short. Here the agent handles only SIGINT/SIGHUP/SIGQUIT; the
preemption signals (SIGTERM, SIGUSR1) this process receives are forwarded to the ranks, also to
ranks that start after the signal came. The ranks run in their own sessions (torchrun starts
them so), so a signal to this process group reaches them only through this forwarding: once.
For the same reason a launcher killed outright (``kill -9``, the OOM killer) would leave them
training on, writing checkpoints beside whatever resumes the run: each rank asks the kernel to
kill it when the launcher dies (`die_with_launcher`).

Rank reports: each rank finds a status folder in ``ARMOR_RANK_STATUS_DIR`` and leaves there
``preempted`` (it saved the preemption checkpoint) or ``rank<R>.error`` (its one-line bad-input
message); the parent turns them into one exit code and at most one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import threading
import time

STATUS_DIR_VAR = "ARMOR_RANK_STATUS_DIR"
LAUNCHER_PID_VAR = "ARMOR_LAUNCHER_PID"
EXIT_LAUNCHER_GONE = 137  # a rank that found its launcher dead, as if it had been SIGKILLed with it
PREEMPTED_FILE = "preempted"
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # what torchrun's agent still handles itself


@dataclasses.dataclass(frozen=True)
class RankReport:
    """A rank's side of the status folder."""

    folder: str
    rank: int

    @classmethod
    def from_env(cls) -> RankReport | None:
        """The report of this rank, or None when the launcher set no status folder."""
        folder = os.environ.get(STATUS_DIR_VAR)
        return None if not folder else cls(folder, int(os.environ.get("RANK", "0")))

    def failed(self, line: str) -> None:
        """Record this rank's one-line failure message."""
        _write(os.path.join(self.folder, f"rank{self.rank}.error"), line)

    def others_failed(self) -> bool:
        """Another rank left its bad-input line (this rank's error is then a consequence)."""
        mine = f"rank{self.rank}.error"
        return any(n.endswith(".error") and n != mine for n in os.listdir(self.folder))

    def preempted(self) -> None:
        """Record that this rank saved the preemption checkpoint."""
        _write(os.path.join(self.folder, PREEMPTED_FILE), str(self.rank))


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a local multi-rank launch ended."""

    code: int  # the first failing rank's exit code (negative: killed by that signal); 0 when all succeeded
    preempted: bool  # a rank saved the preemption checkpoint
    line: str | None  # the first failing rank's one-line message, when it left one
    summary: str  # one line describing the failure for the user
    interrupted: str | None = None  # the signal (SIGINT, SIGHUP, SIGQUIT) that made the agent stop the ranks


class SignalForwarder:
    """Forward ``signals`` received by this process to its child processes (the ranks).

    At once, and to children that appear later (every ``poll_s`` seconds) while installed.
    """

    def __init__(self, signals, poll_s: float = 0.5):
        self.signals = tuple(signals)
        self.poll_s = poll_s
        self.received: list[int] = []
        self._sent: set[tuple[int, int]] = set()  # (pid, signal)
        self._previous: dict = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="armor-signal-forwarder", daemon=True)

    def install(self) -> SignalForwarder:
        """Install the signal handlers and start forwarding; returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        """Stop forwarding and restore the previous signal handlers."""
        self._stop.set()
        self._thread.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        self.forward()

    def forward(self) -> None:
        """Send every received signal to each child process that has not had it yet."""
        import psutil

        with self._lock:
            for child in psutil.Process().children():
                for sig in list(self.received):
                    if (child.pid, sig) not in self._sent:
                        self._sent.add((child.pid, sig))
                        try:
                            os.kill(child.pid, sig)
                        except ProcessLookupError:
                            pass

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.received:
                self.forward()


def die_with_launcher() -> None:
    """In a rank started by `run_ranks`: SIGKILL this rank when the launcher dies.

    Linux's ``PR_SET_PDEATHSIG``; the agent starts the ranks from the launcher's main thread, which
    lives as long as the launcher. A launcher already gone by now ends the rank at once. Elsewhere a
    no-op.
    """
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    if not launcher or not os.environ.get(STATUS_DIR_VAR):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the ranks outlive a killed launcher, as torchrun's do
        return
    if os.getppid() != int(launcher):
        os._exit(EXIT_LAUNCHER_GONE)


STOP_SIGNAL_WAIT_S = 2.0


def wait_for_stop_signal(seconds: float = STOP_SIGNAL_WAIT_S) -> None:
    """Give a stop signal the launcher sent every rank the time to arrive (its handler raises here).

    A rank whose collective failed because a peer left on that signal would otherwise report the
    failure as its own bug, with a traceback, a moment before the signal reaches it.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def run_ranks(torchrun_args: list[str], signals) -> LaunchResult:
    """``torchrun <torchrun_args>`` in this process with the forwarding and reports above."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    saved_env = os.environ.get(STATUS_DIR_VAR)
    with tempfile.TemporaryDirectory(prefix="armor-ranks-") as folder:
        os.environ[STATUS_DIR_VAR] = folder
        os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
        logging.disable(logging.CRITICAL)  # the agent's own failure report: the ranks speak for themselves
        forwarder = SignalForwarder(signals).install()
        first_rank, code, interrupted = None, 0, None
        try:
            torchrun.run(torchrun.parse_args([f"--signals-to-handle={AGENT_SIGNALS}", *torchrun_args]))
        except ChildFailedError as failure:
            first_rank, info = failure.get_first_failure()
            code = info.exitcode
        except SignalException as stop:  # the agent has stopped the ranks (SIGINT, SIGHUP, SIGQUIT)
            interrupted = signal.Signals(stop.sigval).name
            code = 128 + int(stop.sigval)
        finally:
            forwarder.uninstall()
            logging.disable(logging.NOTSET)
            os.environ.pop(LAUNCHER_PID_VAR, None)
            if saved_env is None:
                os.environ.pop(STATUS_DIR_VAR, None)
            else:
                os.environ[STATUS_DIR_VAR] = saved_env
        preempted = os.path.exists(os.path.join(folder, PREEMPTED_FILE))
        line = _first_line(folder, first_rank)
    if interrupted:
        summary = f"interrupted by {interrupted}"
    elif code < 0:
        summary = f"rank {first_rank} was killed by signal {signal.Signals(-code).name}"
    else:
        summary = f"rank {first_rank} exited with code {code} (its output is above)"
    return LaunchResult(code=code, preempted=preempted, line=line, summary=summary, interrupted=interrupted)


def _first_line(folder: str, first_rank: int | None) -> str | None:
    """The first failing rank's message, else the earliest any rank left."""
    errors = sorted((os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".error")), key=os.path.getmtime)
    preferred = os.path.join(folder, f"rank{first_rank}.error")
    for path in ([preferred] if preferred in errors else []) + errors:
        with open(path) as f:
            return f.read().strip()
    return None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
