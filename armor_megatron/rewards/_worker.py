"""Main loop of a reward worker process (see :mod:`armor_megatron.rewards.isolated`).

Run as ``python -m armor_megatron.rewards._worker MEMORY_LIMIT_MB``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

from armor_megatron.rewards.spec import import_callable

_HEADER = struct.Struct("!Q")


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(stream: BinaryIO, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _handle(kind: str, payload: Any) -> Any:
    if kind == "import":
        module, paths = payload
        sys.path.extend(p for p in paths if p not in sys.path)  # reward.python_path: after the installed packages
        importlib.import_module(module)
        return None
    if kind == "call":
        target, args, kwargs = payload
        return import_callable(target)(*args, **kwargs)
    raise ValueError(f"unknown request kind {kind!r}")


def main() -> None:
    # Replies go through a private copy of stdout; stray prints from user code go to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    memory_limit_mb = int(sys.argv[1])
    if memory_limit_mb > 0:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _send(replies, ("ready", None))
    while True:
        header = _read_exact(requests, _HEADER.size)
        if header is None:
            return  # parent closed our stdin (or died)
        body = _read_exact(requests, _HEADER.unpack(header)[0])
        if body is None:
            return
        try:
            kind, payload = pickle.loads(body)
            reply = ("ok", _handle(kind, payload))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            _send(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _send(replies, ("error", f"result is not picklable ({type(exc).__name__}: {exc})"))


if __name__ == "__main__":
    main()
