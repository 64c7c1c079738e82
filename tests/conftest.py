"""Suite-wide rule: every process a test starts is stopped by that test (a ``finally`` or a
fixture: `tests.processes.stopped_after`). At the end of the run, a child of the pytest process
still alive after a grace period fails the run, named, and is killed.

The ranks `tests.megatron.spawn.run_ranks` keeps for the session are stopped first (a clean exit
writes their coverage data). Three helpers are started by the code under test for the whole life of
a process, by design, and are stopped here the way their owners stop them before the check:

* megatron's checkpoint-writer results server (`armor_megatron.megatron.checkpoint.
  _start_writer_results_server`): a ``multiprocessing`` Manager kept while the trainer process
  lives; ``shutdown()`` stops its process and reaps it.
* the answer checkers' worker pool (`armor_megatron.rewards.isolated`): idle workers kept for
  the next verification, stopped by ``shutdown_workers()`` (as its ``atexit`` hook does).
* multiprocessing's resource tracker (started by the first spawned process, e.g. by
  `tests.megatron.spawn.run_ranks`): one per process, it exits once its pipe closes, which
  ``ResourceTracker._stop`` does (and reaps it), as interpreter exit would.
"""

from __future__ import annotations

import sys

import psutil
import pytest

GRACE_S = 10.0


def _stop_lifetime_helpers() -> None:
    spawn = sys.modules.get("tests.megatron.spawn")
    if spawn is not None:  # the ranks `run_ranks` keeps for the session
        spawn.stop_pool()
    checkpoint = sys.modules.get("armor_megatron.megatron.checkpoint")
    if checkpoint is not None and checkpoint._writer_results_server is not None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        checkpoint._writer_results_server.shutdown()
        checkpoint._writer_results_server = None
        filesystem_async._results_queue = None
    isolated = sys.modules.get("armor_megatron.rewards.isolated")
    if isolated is not None:
        isolated.shutdown_workers()
    if "multiprocessing.resource_tracker" in sys.modules:
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}"


def pytest_sessionfinish(session, exitstatus):
    _stop_lifetime_helpers()
    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=GRACE_S)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if not alive:
        return
    names = [_describe(p) for p in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(alive)} process(es) started by the tests outlived them (killed now):\n  " + "\n  ".join(names)
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
