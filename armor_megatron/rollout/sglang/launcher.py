"""Start and stop SGLang server processes (``python -m sglang.launch_server``).

One process per engine, tensor parallelism inside it (``--tp-size``, GPUs
``base_gpu_id + e·tp_size ...``), ports ``base_port + e``, bound to 127.0.0.1 unless
``host`` says otherwise, optional API key. The key never appears on a command line (where
``ps`` shows it to every user of the node): the process starts as
``python -m armor_megatron.rollout.sglang.launcher <server module> <args>``, which reads it from
the ``ARMOR_ENGINE_API_KEY`` environment variable and hands ``--api-key`` to the server in-process. Several engines are used round-robin by
:class:`~armor_megatron.rollout.sglang.engine.SGLangEngine` or put behind ``sglang-router``
(``use_router``: a :class:`~armor_megatron.rollout.sglang.router.SGLangRouter` started once the
engines are up). :meth:`SGLangLauncher.start` returns once every engine answers
``/health_generate`` (and the router routes to all of them); a process that exits first is an
error carrying its log tail, except a server on a port chosen here that another process took
in between (the port is free when chosen, the server binds it seconds later): it is started
again on a new free port, up to ``port_retries`` times. Processes run in their own sessions and are stopped (SIGTERM,
then SIGKILL after a grace period) by :meth:`SGLangLauncher.stop`, at interpreter exit and on
SIGTERM.

Log-probs: the servers report ``log_softmax(logits / temperature)``, SGLang's default and what
the trainer recomputes at ``rollout.temperature``; ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (temperature-1
values) is refused in ``env`` and dropped, with a warning, from the inherited environment.
``deterministic`` adds ``--enable-deterministic-inference`` (see
:mod:`armor_megatron.rollout.sglang.engine` for what it changes and costs).

To use servers started elsewhere, skip the launcher: ``SGLangEngine(worker_urls=[...])``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, cast

from armor_megatron.launch.plan import API_KEY_ENV, QUIET_HEALTH_ENV, lora_server_args
from armor_megatron.rollout.engine import EngineUnavailableError
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.sglang.router import (
    ROUTER_MODULE,
    SGLangRouter,
    free_port,
    local_url,
    log_tail,
    signal_group,
)

logger = logging.getLogger(__name__)

# SGLang 0.5.23 (sglang/srt/layers/sampler.py:82) reports temperature-1 log-probs when this is "1"/"true".
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
# uvicorn's "[Errno 98] error while attempting to bind on address ...: address already in use",
# Python's "OSError: [Errno 98] Address already in use"
ADDRESS_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


@dataclasses.dataclass
class LauncherConfig:
    """How :class:`SGLangLauncher` starts servers on this node.

    No code builds one from a run config (the trainer attaches to ``rollout.sglang.urls``; the SLURM
    plan starts its own servers); building one by hand, a run config's ``rollout.sglang.python`` is
    ``python`` (null there means the trainer's interpreter, ``sys.executable`` here),
    ``rollout.sglang.tp_per_engine`` is ``tp_size``, ``placement: colocated`` is ``colocated``, and
    ``lora.sync: adapter`` is ``lora_rank`` = ``lora.rank`` with ``lora_target_modules`` =
    ``config.schema.lora_peft_modules(lora.target_modules)`` (``--enable-lora ...``).
    """

    model_path: str
    num_engines: int = 1
    tp_size: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: free ports chosen at start
    base_gpu_id: int = 0
    api_key: str | None = None
    use_router: bool = False
    router_port: int = 0  # 0: a free port chosen at start
    router_policy: str = "cache_aware"
    router_health_check_interval_s: int = 5
    router_health_failure_threshold: int = 2
    router_health_check: bool | None = None  # None: off when colocated (its /health probes would generate)
    # adds --enable-memory-saver (weights, KV cache and CUDA graphs can be released) and starts the
    # servers with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION off (`/health` must not generate while released)
    colocated: bool = False
    deterministic: bool = False  # adds --enable-deterministic-inference (seeded, batch-invariant sampling)
    mem_fraction_static: float | None = None
    # LoRA adapters loaded at run time (lora.sync: adapter): the largest rank and the PEFT module names; None: off
    lora_rank: int | None = None
    lora_target_modules: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    server_module: str = "sglang.launch_server"
    router_module: str = ROUTER_MODULE
    python: str = sys.executable  # the SGLang environment's interpreter (a run config's rollout.sglang.python)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_dir: str | None = None
    startup_timeout: float = 900.0
    stop_grace: float = 30.0
    port_retries: int = 3  # new free ports tried per engine whose chosen port was taken before it bound it

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.tp_size < 1:
            raise ValueError(f"need num_engines >= 1 and tp_size >= 1, got {self.num_engines} and {self.tp_size}")
        if ORIGINAL_LOGPROB_ENV in self.env:
            raise ValueError(
                f"env sets {ORIGINAL_LOGPROB_ENV}: the servers would report temperature-1 log-probs, the trainer "
                "computes them at the sampling temperature; remove it"
            )


__all__ = ["LauncherConfig", "SGLangLauncher", "free_port", "run_server_with_env_key"]


class SGLangLauncher:
    """Starts and stops the SGLang server processes (and their router) of one role."""

    def __init__(self, config: LauncherConfig):
        self.config = config
        self.ports: list[int] = []
        self.router: SGLangRouter | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[str] = []
        self._log_starts: list[int] = []  # where each process's part of its log begins
        self._lock = threading.Lock()
        self._prev_sigterm: Any = None

    # ---- commands ------------------------------------------------------------------------

    def server_command(self, engine_index: int, port: int) -> list[str]:
        """The command line of engine ``engine_index`` listening on ``port``."""
        c = self.config
        cmd = [
            *self._entry(c.server_module),
            "--model-path",
            c.model_path,
            "--host",
            c.host,
            "--port",
            str(port),
            "--tp-size",
            str(c.tp_size),
            "--base-gpu-id",
            str(c.base_gpu_id + engine_index * c.tp_size),
        ]
        if c.colocated:
            cmd += ["--enable-memory-saver"]
        if c.deterministic:
            cmd += [DETERMINISTIC_FLAG]
        if c.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.lora_rank is not None:
            cmd += lora_server_args(c.lora_rank, c.lora_target_modules)
        return cmd + list(c.extra_args)

    def make_router(self, log_path: str | None = None) -> SGLangRouter:
        """The router in front of this launcher's engines (not started)."""
        c = self.config
        return SGLangRouter(
            self.worker_urls,
            host=c.host,
            port=c.router_port,
            policy=c.router_policy,
            api_key=c.api_key,
            health_check_interval_s=c.router_health_check_interval_s,
            health_failure_threshold=c.router_health_failure_threshold,
            health_check=not c.colocated if c.router_health_check is None else c.router_health_check,
            startup_timeout=c.startup_timeout,
            stop_grace=c.stop_grace,
            log_path=log_path,
            python=c.python,
            module=c.router_module,
        )

    def router_command(self, port: int) -> list[str]:
        """The router's command line for ``port``."""
        return self.make_router().command(port, free_port(self.config.host))

    def _entry(self, module: str) -> list[str]:
        """``python -m module``, or, with an API key, this module's key-from-environment wrapper of it."""
        c = self.config
        return [c.python, "-m", __name__, module] if c.api_key else [c.python, "-m", module]

    @property
    def worker_urls(self) -> list[str]:
        """The URLs of the started servers."""
        return [local_url(self.config.host, p) for p in self.ports]

    @property
    def router_url(self) -> str | None:
        """The router's URL, None without a router."""
        return None if self.router is None else self.router.url

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> SGLangLauncher:
        """Start the servers (and the router), wait until they are healthy; returns self."""
        c = self.config
        if self._procs:
            raise RuntimeError("SGLang servers already started")
        self._install_exit_handlers()
        log_dir = c.log_dir or tempfile.mkdtemp(prefix="armor-sglang-")
        os.makedirs(log_dir, exist_ok=True)
        self.ports = []
        for e in range(c.num_engines):
            self.ports.append(c.base_port + e if c.base_port else self._new_port())
        try:
            for e, port in enumerate(self.ports):
                self._spawn(self.server_command(e, port), os.path.join(log_dir, f"engine-{e}.log"))
            deadline = time.monotonic() + c.startup_timeout
            for e in range(c.num_engines):
                self._wait_healthy_or_move(e, deadline)
            if c.use_router:
                self.router = self.make_router(os.path.join(log_dir, "router.log"))
                self.router.startup_timeout = max(1.0, deadline - time.monotonic())
                self.router.start()
        except BaseException:
            self.stop()
            raise
        logger.info(
            "SGLang engines up: %s%s", self.worker_urls, f" behind router {self.router_url}" if self.router_url else ""
        )
        return self

    def _spawn(self, cmd: list[str], log_path: str, index: int | None = None) -> None:
        """Start ``cmd`` logging to ``log_path``: a new engine, or a replacement of engine ``index``."""
        quiet = QUIET_HEALTH_ENV if self.config.colocated else {}  # before `env`: a test may restore SGLang's default
        env = {**os.environ, **quiet, **self.config.env}
        if self.config.api_key:
            env[API_KEY_ENV] = self.config.api_key
        if env.pop(ORIGINAL_LOGPROB_ENV, None) is not None:
            logger.warning(
                "not passing %s to the SGLang servers: log-probs stay at the sampling temperature, as the trainer's",
                ORIGINAL_LOGPROB_ENV,
            )
        with open(log_path, "ab") as log:
            start = log.tell()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with self._lock:
            if index is None:
                self._procs.append(proc)
                self._logs.append(log_path)
                self._log_starts.append(start)
            else:
                self._procs[index], self._log_starts[index] = proc, start

    def _wait_healthy_or_move(self, index: int, deadline: float) -> None:
        """Wait for engine ``index``; if its free port was taken before it bound it, start it on another."""
        for attempt in range(self.config.port_retries + 1):
            try:
                return self._wait_healthy(index, self.worker_urls[index], deadline)
            except EngineUnavailableError:
                if self.config.base_port or attempt == self.config.port_retries or not self._lost_its_port(index):
                    raise
            old, self.ports[index] = self.ports[index], self._new_port()
            logger.warning(
                "SGLang engine %d: port %d was taken before it bound it; retrying on port %d",
                index,
                old,
                self.ports[index],
            )
            self._spawn(self.server_command(index, self.ports[index]), self._logs[index], index=index)

    def _new_port(self) -> int:
        """A free port none of this launcher's engines was given (the OS may hand one out twice)."""
        for _ in range(100):
            port = free_port(self.config.host)
            if port not in self.ports:
                return port
        raise EngineUnavailableError(f"no free port on {self.config.host} that the engines do not already use")

    def _lost_its_port(self, index: int) -> bool:
        """Whether engine ``index`` exited because its port was in use (read from its part of the log)."""
        if self._procs[index].poll() is None:
            return False
        with open(self._logs[index], "rb") as f:
            f.seek(self._log_starts[index])
            return bool(ADDRESS_IN_USE.search(f.read().decode(errors="replace")))

    def _wait_healthy(self, index: int, url: str, deadline: float, path_generate: bool = True) -> None:
        client = SGLangClient(url, api_key=self.config.api_key)
        proc = self._procs[index]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineUnavailableError(
                    f"SGLang process {' '.join(cast(list[str], proc.args)[:3])} for {url} exited with code {proc.returncode}; "
                    f"log tail ({self._logs[index]}):\n{log_tail(self._logs[index])}"
                )
            if client.health(generate=path_generate, timeout=5.0):
                return
            time.sleep(0.5)
        raise EngineUnavailableError(
            f"SGLang server {url} not healthy after {self.config.startup_timeout:.0f}s; log tail:\n{log_tail(self._logs[index])}"
        )

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is still alive after the grace period."""
        with self._lock:
            procs, self._procs = self._procs, []
            router, self.router = self.router, None
        grace = self.config.stop_grace if timeout is None else timeout
        if router is not None:  # the router first: it stops sending requests to engines going away
            router.stop(timeout=grace)
        for p in procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("SGLang process %d ignored SIGTERM for %.0fs; killing it", p.pid, grace)
                signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)

    @property
    def running(self) -> bool:
        """Whether any server or the router is still running."""
        return any(p.poll() is None for p in self._procs) or (self.router is not None and self.router.running)

    def _install_exit_handlers(self) -> None:
        atexit.register(self.stop)
        if threading.current_thread() is not threading.main_thread():
            return
        self._prev_sigterm = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self.stop()
            prev = self._prev_sigterm
            if callable(prev):
                prev(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def __enter__(self) -> SGLangLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server_with_env_key(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> None:
    """``python -m armor_megatron.rollout.sglang.launcher MODULE ARGS...``.

    Run ``MODULE`` as ``__main__`` with ``ARGS + --api-key $ARMOR_ENGINE_API_KEY``. The key is added
    to this process's ``sys.argv`` only, not to its command line (``/proc/<pid>/cmdline``).
    """
    import runpy

    if not argv:
        raise SystemExit(f"usage: python -m {__name__} MODULE [ARGS...] (key in ${API_KEY_ENV})")
    key = environ.get(API_KEY_ENV)
    if not key:
        raise SystemExit(f"{__name__}: {API_KEY_ENV} is not set (the API key for {argv[0]})")
    sys.argv = [argv[0], *argv[1:], "--api-key", key]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run_server_with_env_key(sys.argv[1:])
