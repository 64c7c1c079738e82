"""A remote judge serving any verifier over HTTP, in the protocol of ``reward.remote`` (docs/rewards.md).

Move a slow verifier off the trainer node: run this where the verifier should run,

    python examples/judge_server.py --verifier my_rewards:judge --port 8000 --python-path /path/to/my_run
    JUDGE_KEY=secret python examples/judge_server.py --verifier math --api-key-env JUDGE_KEY

and point the run at it:

    reward: {verifier: remote, remote: {url: "http://judge-node:8000/", api_key_env: JUDGE_KEY}}

Each ``POST`` carries ``{"items": [{prompt, response, ground_truth, data_source, extra_info}, ...]}``
and gets ``{"scores": [...], "details": [breakdown, ...]}``. The verifier (a registered name or
``module:function``) runs as it would in the trainer: a user verifier in a killable reward worker
process under ``--timeout-s``, given the row fields it names; a group verifier gets the items of
one request that share a prompt together. A request that is not the protocol's gets HTTP 400, a
verifier that raises or returns no reward HTTP 422 (the trainer fails at once, with this line), a
wrong key HTTP 401.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from armor_megatron.rewards import configure_pool, load_verifier, score_batch
from armor_megatron.rewards.spec import add_search_paths
from armor_megatron.rewards.user_calls import configure_user_verifiers

MAX_REQUEST_BYTES = 256 << 20


def make_server(verifier: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, workers: int = 4):
    """An HTTP server (not started) scoring with ``verifier``; ``api_key``: the Bearer key it requires."""
    load_verifier(verifier)  # a spec that does not load fails here, in one line

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if api_key is not None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return self._reply(401, {"error": "missing or wrong API key"})
            try:
                items = _items(self._body())
            except ValueError as err:
                return self._reply(400, {"error": str(err)})
            try:
                results = score_batch(
                    [item["response"] for item in items],
                    [item.get("ground_truth") for item in items],
                    verifier,
                    max_workers=workers,
                    labels=[f"item {i}" for i in range(len(items))],
                    fields=[{k: item.get(k) for k in ("prompt", "data_source", "extra_info")} for item in items],
                    groups=[json.dumps(item.get("prompt"), sort_keys=True) for item in items],
                )
            except ValueError as err:  # the verifier raised, or returned no reward (UserInputError)
                return self._reply(422, {"error": str(err).splitlines()[0]})
            self._reply(200, {"scores": [r.score for r in results], "details": [r.breakdown for r in results]})

        def _body(self) -> Any:
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 < size <= MAX_REQUEST_BYTES:
                raise ValueError(f"request body of {size} bytes (1..{MAX_REQUEST_BYTES} accepted)")
            try:
                return json.loads(self.rfile.read(size))
            except ValueError:
                raise ValueError("request body is not JSON") from None

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
            pass  # one line per request would drown the verifier's own output

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _items(request: Any) -> list[dict[str, Any]]:
    items = request.get("items") if isinstance(request, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError('request must be {"items": [...]}, a non-empty list')
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("response"), str):
            raise ValueError(f'item {i} must be a mapping with a string "response"')
    return items


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until interrupted."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", required=True, help="registered name or module:function")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--python-path", action="append", default=[], help="directory of the verifier's module")
    p.add_argument("--api-key-env", help="environment variable holding the key clients must send")
    p.add_argument("--workers", type=int, default=4, help="verifier calls at once")
    p.add_argument("--timeout-s", type=float, default=60.0, help="seconds one verifier call may take")
    args = p.parse_args(argv)
    add_search_paths([*args.python_path, os.getcwd()])
    configure_user_verifiers(timeout_s=args.timeout_s)
    configure_pool(max_workers=args.workers)
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            sys.exit(f"judge_server: error: environment variable {args.api_key_env} is not set")
    try:
        server = make_server(args.verifier, args.host, args.port, key, args.workers)
    except ValueError as err:
        sys.exit(f"judge_server: error: {str(err).splitlines()[0]}")
    print(f"judge_server: {args.verifier} on http://{args.host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
