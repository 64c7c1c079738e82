"""``sglang-router`` in front of one engine group: start, wait until it routes, list its workers, stop.

The router (``python -m sglang_router.launch_router``, a Rust binary from the ``sglang-router``
wheel; runs on CPU) spreads ``/generate`` requests over the group's servers (``cache_aware``:
to the server whose prefix cache holds most of the prompt while loads stay balanced) and
health-checks them every ``health_check_interval_s``; after ``health_failure_threshold``
failed checks in a row it stops routing to a server (a request that meets a dead server
first is retried on another). Only generation goes through it: weight updates, memory
release and pause go to each server directly (the router does not forward them).

What 0.3.2 does, checked against the binary:

* it answers ``/health`` at once, before any worker has registered (registration runs in the
  background after ``--worker-urls``): :meth:`SGLangRouter.start` waits for ``/readiness``
  to count every worker healthy instead;
* it reads each worker's ``/server_info`` (falling back to ``/get_server_info``) and
  ``/model_info``, and loads the tokenizer from the reported ``model_path``;
* it re-serializes ``/generate`` bodies: unknown ``sampling_params`` keys are dropped
  (SGLang itself answers 400), and ``sampling_params`` must be one dict, not a list per
  prompt (HTTP 422);
* with no healthy worker ``/generate`` answers 503 ``no_available_workers``;
* ``--api-key`` makes the router demand the key of its clients and pass it to the workers;
  like the servers' key it never goes on a command line (the launcher's key-from-environment
  wrapper adds it in-process);
* it health-checks every worker at ``--health-check-endpoint`` (``/health``) every
  ``--health-check-interval-secs``; SGLang 0.5.23's ``/health`` generates a token unless the
  server runs with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` off, and a generation on an engine
  whose memory is released kills it. With colocated engines the router therefore runs with
  ``--disable-health-check`` (``health_check=False``; slime does the same: slime/ray/rollout.py,
  ``router_args.disable_health_check = True``), and a dead engine shows up as failed requests;
* it always serves Prometheus metrics (default port 29000 on all interfaces, so two routers on
  one node clash): each router gets its own free port on ``host``. A port taken between
  choosing and binding makes the router exit with "Address already in use"; start then tries
  fresh ports.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from armor_megatron.launch.plan import API_KEY_ENV
from armor_megatron.rollout.engine import EngineUnavailableError, RolloutError
from armor_megatron.rollout.sglang.client import SGLangClient

logger = logging.getLogger(__name__)

ROUTER_MODULE = "sglang_router.launch_router"
KEY_WRAPPER = "armor_megatron.rollout.sglang.launcher"  # runs a module with --api-key from the environment
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
NOT_INSTALLED = "sglang-router is not installed: pip install 'armor_megatron[sglang]'"
PORT_ATTEMPTS = 3


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it before we bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def local_url(host: str, port: int) -> str:
    """``http://host:port``, with a wildcard bind address replaced by loopback (where a client can connect)."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (it and its children) if it still runs."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def log_tail(path: str, lines: int = 20) -> str:
    """The last ``lines`` lines of the log at ``path`` ('' when unreadable)."""
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return "(no log)"


class SGLangRouter:
    """One ``sglang-router`` process in front of ``worker_urls``.

    ``port`` 0 picks a free port (and retries on a lost race); ``startup_timeout`` bounds
    :meth:`start`; ``request_timeout`` is the router's own per-request limit (seconds);
    ``health_check=False`` turns the router's periodic worker checks off (colocated engines).
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        policy: str = "cache_aware",
        api_key: str | None = None,
        health_check_interval_s: int = 5,
        health_failure_threshold: int = 2,
        health_check: bool = True,
        request_timeout: float = 1800.0,
        startup_timeout: float = 300.0,
        stop_grace: float = 10.0,
        log_path: str | None = None,
        python: str = sys.executable,
        module: str = ROUTER_MODULE,
        extra_args: Sequence[str] = (),
    ):
        if not worker_urls:
            raise ValueError("SGLangRouter needs at least one worker URL")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        if health_check_interval_s < 1 or health_failure_threshold < 1:
            raise ValueError(
                f"need health_check_interval_s >= 1 and health_failure_threshold >= 1, got "
                f"{health_check_interval_s} and {health_failure_threshold}"
            )
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.host, self.requested_port, self.policy, self.api_key = host, port, policy, api_key
        self.health_check_interval_s = int(health_check_interval_s)
        self.health_failure_threshold = int(health_failure_threshold)
        self.health_check = health_check
        self.request_timeout, self.startup_timeout, self.stop_grace = request_timeout, startup_timeout, stop_grace
        self.log_path = log_path
        self.python, self.module, self.extra_args = python, module, list(extra_args)
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._atexit = False

    @property
    def url(self) -> str:
        """The router's URL; raises before it started."""
        if self.port is None:
            raise RuntimeError("the SGLang router is not started")
        return local_url(self.host, self.port)

    def command(self, port: int, metrics_port: int) -> list[str]:
        """The router's command line (never the API key: with one it runs under the key-from-environment wrapper)."""
        entry = [self.python, "-m", KEY_WRAPPER, self.module] if self.api_key else [self.python, "-m", self.module]
        return [
            *entry,
            "--host",
            self.host,
            "--port",
            str(port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            self.policy,
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(metrics_port),
            "--health-check-interval-secs",
            str(self.health_check_interval_s),
            "--health-failure-threshold",
            str(self.health_failure_threshold),
            *([] if self.health_check else ["--disable-health-check"]),
            "--worker-startup-check-interval",
            "1",
            "--worker-startup-timeout-secs",
            str(max(1, int(self.startup_timeout))),
            "--request-timeout-secs",
            str(max(1, int(self.request_timeout))),
            "--shutdown-grace-period-secs",
            str(max(1, int(self.stop_grace))),
            *self.extra_args,
        ]

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> SGLangRouter:
        """Start the router and return once it counts every worker healthy; a clear error otherwise."""
        if self.proc is not None:
            raise RuntimeError("the SGLang router is already started")
        if importlib.util.find_spec(self.module.split(".")[0]) is None:
            raise EngineUnavailableError(NOT_INSTALLED)
        if self.log_path is None:
            self.log_path = os.path.join(tempfile.mkdtemp(prefix="armor-sglang-router-"), "router.log")
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        deadline = time.monotonic() + self.startup_timeout
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = self.requested_port or free_port(self.host)
            self._spawn(self.command(port, free_port(self.host)))
            self.port = port
            try:
                self._wait_ready(deadline)
                logger.info("SGLang router %s (%s) in front of %s", self.url, self.policy, self.worker_urls)
                return self
            except _PortTaken:
                self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise EngineUnavailableError(
                        f"SGLang router: ports taken by other processes {PORT_ATTEMPTS} times in a row; "
                        f"log tail ({self.log_path}):\n{log_tail(self.log_path)}"
                    ) from None
                logger.warning("SGLang router lost a port race (attempt %d); retrying on fresh ports", attempt)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _spawn(self, cmd: list[str]) -> None:
        env = dict(os.environ)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        assert self.log_path is not None  # start() names one
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_ready(self, deadline: float) -> None:
        client = self._client()
        proc, log_path = self.proc, self.log_path
        assert proc is not None and log_path is not None  # _spawn started it, logging there
        ready = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_tail(log_path)
                if "Address already in use" in tail:
                    raise _PortTaken()
                raise EngineUnavailableError(
                    f"SGLang router exited with code {proc.returncode}; log tail ({log_path}):\n{tail}"
                )
            try:
                ready = client.get("/readiness", timeout=5.0, retry=False)
            except RolloutError as e:
                ready = str(e)  # 503 until a worker is healthy; connection refused until it listens
            if isinstance(ready, dict) and ready.get("healthy_workers", 0) >= len(self.worker_urls):
                return
            time.sleep(0.2)
        raise EngineUnavailableError(
            f"SGLang router {self.url} not routing to all {len(self.worker_urls)} workers after "
            f"{self.startup_timeout:.0f}s (last /readiness: {ready}); log tail ({log_path}):\n{log_tail(log_path)}"
        )

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the router, SIGKILL it if it is still alive after the grace period."""
        proc, self.proc = self.proc, None
        self.port = None
        if proc is None:
            return
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            logger.warning("SGLang router %d ignored SIGTERM; killing it", proc.pid)
            signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)

    @property
    def running(self) -> bool:
        """Whether the router process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> SGLangRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- state -----------------------------------------------------------------------------

    def _client(self) -> SGLangClient:
        return SGLangClient(self.url, api_key=self.api_key, request_timeout=10.0)

    def workers(self, timeout: float = 10.0) -> dict[str, bool]:
        """``{worker url: healthy}`` as the router sees it now (``GET /workers``)."""
        listing = self._client().get("/workers", timeout=timeout, retry=False)
        return {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in (listing or {}).get("workers", [])}


class _PortTaken(Exception):
    """The router exited because its port (or its metrics port) was taken after we chose it."""
