"""Wait until SGLang servers answer ``GET /health_generate`` with 200, or fail with one clear line.

The batch script starts the engine steps in the background, then calls this with their process ids:
an engine step that exits while we wait is a failure at once, not after the timeout.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


class EngineStartError(RuntimeError):
    """An engine did not become healthy."""


def is_healthy(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> bool:
    """Whether the SGLang server at ``url`` answers ``/health_generate`` within ``timeout_s``."""
    request = urllib.request.Request(url.rstrip("/") + "/health_generate")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_for_engines(
    urls: Sequence[str],
    *,
    timeout_s: float,
    pids: Sequence[int] = (),
    api_key: str | None = None,
    poll_s: float = 2.0,
) -> float:
    """Block until every URL is healthy; return the seconds waited. Raises EngineStartError."""
    start = time.monotonic()
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not is_healthy(u, api_key, timeout_s=min(10.0, timeout_s))]
        if not pending:
            break
        dead = [pid for pid in pids if not _alive(pid)]
        if dead:
            raise EngineStartError(
                f"engine step(s) {', '.join(map(str, dead))} exited before {', '.join(pending)} became healthy"
            )
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise EngineStartError(f"{len(pending)} engine(s) not healthy after {waited:.0f}s: {', '.join(pending)}")
        time.sleep(min(poll_s, max(0.0, timeout_s - waited)))
    return time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child that exited but was not reaped yet is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
