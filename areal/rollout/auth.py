"""Who may command an inference server: SGLang's `--api-key` semantics, and where weights
may be loaded from.

    rollout worker / eval --Authorization: Bearer KEY--> server: 401 without it (counted, logged)
    controller --update_weights_from_disk(path)--> server: only under its weight roots

The key of a run is derived from the experiment's key (registry/key, mode 0600), so every
role that may sign frames may also talk to the servers, and nothing new is stored. It
reaches an embedded server through its environment (AREAL_API_KEY; a command line is
readable by every user of the node), SGLang through `--api-key`. Like SGLang, /health
answers without a key (a liveness probe carries no secret and changes nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from areal.comm.registry import load_key

log = logging.getLogger(__name__)

API_KEY_ENV = "AREAL_API_KEY"
"""The environment variable an embedded server (and areal.eval) reads its key from."""
_OPEN_PATHS = ("/health", "/metrics")  # SGLang's api-key middleware lets these through


def api_key(exp_dir: str | os.PathLike) -> str:
    """The inference servers' API key of the run in exp_dir."""
    return hmac.new(load_key(exp_dir), b"areal inference api key", hashlib.sha256).hexdigest()


def auth_header(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def require_api_key(key: str) -> web.middleware:
    """Middleware: 401 for a request without `Authorization: Bearer {key}` (bar /health)."""
    expected = f"Bearer {key}".encode()
    rejected = 0

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal rejected
        if request.method == "OPTIONS" or request.path.startswith(_OPEN_PATHS):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return await handler(request)
        rejected += 1
        log.warning(
            "unauthorized request %d: %s %s from %s (%s)", rejected, request.method,
            request.path, request.remote, "wrong key" if given else "no Authorization header",
        )  # fmt: skip
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)

    return check


def weights_path_problem(path: str, roots: list[str]) -> str | None:
    """None if `path` lies under one of `roots` (after resolving links and ..), else why not.
    No roots: anything goes (a standalone server, like SGLang)."""
    if not roots:
        return None
    real = Path(path).resolve()
    for root in roots:
        if real.is_relative_to(Path(root).resolve()):
            return None
    return f"{path} is not under any directory this server loads weights from ({roots})"


if __name__ == "__main__":  # python -m areal.rollout.auth EXP_DIR: the run's servers' key
    import sys

    print(api_key(sys.argv[1]))
