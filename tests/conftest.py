"""Two suite-wide rules.

**Slow tests are marked by measurement.** A test not marked ``slow`` whose call and own set-up
(its function-scoped fixtures) take more than ``ARMOR_SLOW_TEST_SECONDS`` seconds (default 10,
doubled when the process may use only one core: a test's two ranks then share it; the fast
subset is ``-m "not slow"``) fails, with a line asking to mark it ``@pytest.mark.slow`` or make
it faster. A test takes the lesser of its wall time and its CPU time: the CPU time of the pytest
process (all threads) and of every process below it (children, theirs, and the ranks a session
keeps, for what they did during the test). A test that did its work quickly but waited for a
core on a busy machine is judged by its CPU time, so load never fails it; a genuinely slow test
on an idle machine exceeds both. A shared (module-, class- or session-scoped) fixture is judged
on its own, whichever test sets it up first: over the limit, the unmarked test that set it up
fails, naming it. ``0`` turns the check off. A test that failed or was skipped is left as it is.

**The suite's clock.** The run ends with one line, ``suite clock: N tests in W s wall, C s CPU;
not marked slow: n tests, c s CPU`` (CPU: the pytest process and every process below it, as above;
a test's own figure covers its set-up, call and tear-down, and a shared fixture counts in the test
that set it up). CI prints it for the whole suite and for the fast subset, whose budget is judged
on CPU seconds so that a loaded machine does not move it. ``ARMOR_CPU_DURATIONS=<n>`` lists the
n tests that took the most CPU above it, as ``--durations`` does for wall time.

**Processes.** Every process a test starts is stopped by that test (a ``finally`` or a
fixture: `tests.processes.stopped_after`). At the end of the run, a child of the pytest process
still alive after a grace period (``ARMOR_LEFTOVER_GRACE_SECONDS``, default 10) fails the run,
named, and is killed.

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

import os
import sys
import time

import psutil
import pytest

GRACE_ENV = "ARMOR_LEFTOVER_GRACE_SECONDS"
GRACE_DEFAULT_S = 10.0
SLOW_ENV = "ARMOR_SLOW_TEST_SECONDS"
SLOW_DEFAULT_S = 10.0


def _env_number(env: str, default: float, parse: type = float, meaning: str = "a number of seconds") -> float:
    raw = os.environ.get(env, "")
    try:
        return parse(raw) if raw.strip() else default
    except ValueError:
        raise pytest.UsageError(f"{env}={raw!r} is not {meaning}") from None


def slow_limit_s() -> float:
    """The time limit of a test not marked slow (``ARMOR_SLOW_TEST_SECONDS``; 0: no limit).

    The default is set for 2 cores; with one core usable (``taskset -c 0``) it doubles.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return _env_number(SLOW_ENV, SLOW_DEFAULT_S * (2.0 if cores < 2 else 1.0))


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux: /proc/<pid>/task/*/children, no scan of every process)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.Error:
            return []
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _cpu_of(pid: int) -> tuple[tuple[int, float], float] | None:
    """((pid, start time), CPU seconds of ``pid`` and of its children it reaped); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        user, system, child_user, child_system = (int(x) for x in fields[11:15])
        return (pid, float(fields[19])), (user + system + child_user + child_system) * _TICK_S
    except (OSError, IndexError, ValueError):
        try:
            p = psutil.Process(pid)
            t = p.cpu_times()
            return (pid, p.create_time()), t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            return None


def cpu_snapshot() -> tuple[float, dict[tuple[int, float], float]]:
    """CPU seconds so far of this process with its reaped children, and of each live process below it."""
    t = os.times()
    live: dict[tuple[int, float], float] = {}
    stack = [os.getpid()]
    while stack:
        for child in _children_of(stack.pop()):
            measured = _cpu_of(child)
            if measured is not None:
                live[measured[0]] = measured[1]
                stack.append(child)
    return t.user + t.system + t.children_user + t.children_system, live


def cpu_seconds_since(start: tuple[float, dict[tuple[int, float], float]]) -> float:
    """CPU seconds this process and every process below it spent since ``start`` (a `cpu_snapshot`).

    A process that ended in between was reaped by one of them, whose children's times now hold all
    of its CPU time: what it had used before ``start`` is taken off.
    """
    own, live = cpu_snapshot()
    spent = own - start[0] + sum(cpu - start[1].get(key, 0.0) for key, cpu in live.items())
    spent -= sum(cpu for key, cpu in start[1].items() if key not in live)
    return max(0.0, spent)


class _Clock:
    """Wall and CPU time since it was made; a test takes the lesser (module docstring)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), cpu_snapshot()

    def since(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the clock was made."""
        return time.perf_counter() - self.wall, cpu_seconds_since(self.cpu)


_LIMIT = pytest.StashKey[float]()
_TOOK_S = pytest.StashKey[float]()
_SHARED_SETUPS = pytest.StashKey[list]()
# (fixture, wall seconds, CPU seconds) of the shared fixtures set up for the running test
_shared_setups: list[tuple[str, float, float]] = []
_shared_depth = 0  # shared fixtures being set up (one may request another)


def pytest_configure(config):
    config.stash[_LIMIT] = slow_limit_s()
    config.stash[_HEAVIEST_N] = int(_env_number(HEAVIEST_ENV, 0, int, "a number of tests"))


_SUITE_START = pytest.StashKey[tuple[float, tuple[float, dict[tuple[int, float], float]]]]()
_TEST_CPU_S = pytest.StashKey[dict[bool, list[float]]]()  # slow or not: each finished test's CPU seconds
_HEAVIEST: list[tuple[float, str]] = []  # (CPU seconds, test id) of every finished test
_HEAVIEST_N = pytest.StashKey[int]()
HEAVIEST_ENV = "ARMOR_CPU_DURATIONS"  # <n>: the suite clock is followed by the n tests that took the most CPU


_CLOCK_CONFIG: list[pytest.Config] = []  # the run's config, for pytest_runtest_logreport (no config argument)


def pytest_sessionstart(session):
    session.config.stash[_SUITE_START] = (time.perf_counter(), cpu_snapshot())
    session.config.stash[_TEST_CPU_S] = {True: [], False: []}
    _CLOCK_CONFIG[:] = [session.config]


_TEST_CLOCK = pytest.StashKey[_Clock]()
_CPU_PROPERTY = "suite_clock_cpu_s"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One clock per test, started before its set-up: its judged time (set-up and call) and its
    CPU figure for the suite clock (up to the end of its tear-down) are both read off it. Reading
    the CPU clock walks the process tree, so it is read only where a figure needs it."""
    item.stash[_TEST_CLOCK] = _Clock()
    yield


def pytest_runtest_logreport(report):
    """Counts a finished test's CPU seconds, carried on its tear-down report: under pytest-xdist
    (``-n 2``) the report reaches the controlling process, which prints the clock."""
    for name, value in report.user_properties if report.when == "teardown" else ():
        if name == _CPU_PROPERTY:
            slow, cpu_s = value
            _CLOCK_CONFIG[0].stash[_TEST_CPU_S][slow].append(cpu_s)
            _HEAVIEST.append((cpu_s, report.nodeid))


def suite_clock_line(wall_s: float, cpu_s: float, tests_cpu_s: dict[bool, list[float]]) -> str:
    """The run's closing line: all tests with the run's wall and CPU time, then the unmarked ones' CPU."""
    fast = tests_cpu_s[False]
    return (
        f"suite clock: {len(fast) + len(tests_cpu_s[True])} tests in {wall_s:.1f} s wall, {cpu_s:.1f} s CPU; "
        f"not marked slow: {len(fast)} tests, {sum(fast):.1f} s CPU"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    start = config.stash.get(_SUITE_START, None)
    if start is None:
        return
    wall_s = time.perf_counter() - start[0]
    line = suite_clock_line(wall_s, cpu_seconds_since(start[1]), config.stash[_TEST_CPU_S])
    terminalreporter.ensure_newline()
    for cpu_s, nodeid in sorted(_HEAVIEST, reverse=True)[: config.stash[_HEAVIEST_N]]:
        terminalreporter.write_line(f"{cpu_s:8.1f} s CPU  {nodeid}")
    terminalreporter.write_line(line)


def _judged(item) -> bool:
    limit = item.config.stash.get(_LIMIT, SLOW_DEFAULT_S)
    return limit > 0 and item.get_closest_marker("slow") is None


def pytest_runtest_setup(item):
    _shared_setups.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Measures set-up and call together, less the shared fixtures that set-up started (judged on
    their own): its wall time, and its CPU time only where the wall time is over the limit (the
    lesser of the two is under the limit whenever the wall time is)."""
    yield
    clock = item.stash.get(_TEST_CLOCK, None)
    if clock is None or not _judged(item):
        return
    limit = item.config.stash.get(_LIMIT, SLOW_DEFAULT_S)
    wall_s = time.perf_counter() - clock.wall - sum(wall for _, wall, _ in _shared_setups)
    took = wall_s
    if wall_s > limit:
        took = min(wall_s, cpu_seconds_since(clock.cpu) - sum(cpu for _, _, cpu in _shared_setups))
    item.stash[_TOOK_S] = took
    item.stash[_SHARED_SETUPS] = list(_shared_setups)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Times the set-up of module-, class-, package- and session-scoped fixtures: the first test
    using one must not pay for it (the order varies), the fixture is judged on its own."""
    global _shared_depth
    shared = fixturedef.scope != "function"
    clock = _Clock() if shared and not _shared_depth else None
    _shared_depth += shared
    yield
    _shared_depth -= shared
    if clock is not None:
        _shared_setups.append((fixturedef.argname, *clock.since()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _TEST_CLOCK in item.stash:
        slow = item.get_closest_marker("slow") is not None
        report.user_properties.append((_CPU_PROPERTY, (slow, cpu_seconds_since(item.stash[_TEST_CLOCK].cpu))))
    limit = item.config.stash.get(_LIMIT, SLOW_DEFAULT_S)
    if report.when != "call" or not report.passed or not _judged(item) or _TOOK_S not in item.stash:
        return
    took = item.stash[_TOOK_S]
    over = f"over the {limit:g} s limit of a test not marked slow ({SLOW_ENV})"
    if took > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s (its set-up and call; wall or CPU time, the lesser), {over}: "
            "mark it @pytest.mark.slow or make it faster"
        )
        return
    for fixture, wall_s, cpu_s in item.stash.get(_SHARED_SETUPS, []):
        if min(wall_s, cpu_s) > limit:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid}: its shared fixture {fixture!r} took {min(wall_s, cpu_s):.1f} s to set up, {over}: "
                "mark the tests that use it @pytest.mark.slow or make it faster"
            )
            return


@pytest.fixture(scope="module")
def world_of_one():
    """torch.distributed and megatron-core's model-parallel state of this process alone (gloo,
    world size 1, TP=PP=1), for in-process Megatron tests; started once per module and stopped
    after it, so that a later module may start its own (`megatron.verify.single_process_megatron`)."""
    from armor_megatron.megatron import dist as mdist

    mdist.initialize(mdist.ParallelConfig(), environ={})
    yield
    mdist.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_process_group_outlives_its_module(request):
    """A module whose tests leave torch.distributed's default process group initialised fails (the
    group is destroyed): a later test starting its own would fail by order alone."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from armor_megatron.megatron import dist as mdist

    mdist.shutdown()
    pytest.fail(
        f"{request.module.__name__} left torch.distributed's default process group initialised; "
        "stop it in the test or use the world_of_one fixture"
    )


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
    grace_s = _env_number(GRACE_ENV, GRACE_DEFAULT_S)
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if not alive:
        return
    names = [_describe(p) for p in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(alive)} process(es) started by the tests outlived them (killed now):\n  " + "\n  ".join(names)
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
