"""Code that runs inside a vLLM server: an exact weight reload and our API-key rule.

```
 VLLMClient --Authorization: Bearer KEY--> RequireAPIKey, StartWeightVersion (--middleware)
                                                                      --> vLLM API server
            --POST /collective_rpc {"method": "areal_reload_weights"}--> engine core
                                                --> AReaLWorker (--worker-extension-cls) --> model
```

Imported by the vLLM environment's interpreter, which has none of areal's own dependencies:
only the standard library, vLLM and torch are imported here (the launcher puts the repository
root on the server's PYTHONPATH; areal/__init__.py and areal/rollout/__init__.py import
nothing).

StartWeightVersion: vLLM starts at weight version "default" and has no flag for another;
a resumed run's server starts from checkpoint N and must report N.

RequireAPIKey: vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and
/cohere; the development routes a weight update needs (/pause, /resume, /collective_rpc,
/update_weight_version, /abort_requests, ...) answer anyone. This middleware applies SGLang's
rule instead (and the embedded server's, areal/rollout/auth.py): every path but /health and
/metrics needs `Authorization: Bearer $AREAL_API_KEY`. The key comes from the environment,
not the command line (which every user of the node can read).

AReaLWorker: vLLM mixes this class into its worker class, so `self` is the worker
(`self.model_runner`, `self.vllm_config`); /collective_rpc calls its methods by name.

Why not vLLM's own `reload_weights`: on CPU every linear layer keeps a packed copy of its
weight (oneDNN or sgl-kernel layout) made once after loading. An in-place reload re-packs
each layer whose parameters it loads, but the LM head of a model with tied embeddings owns
no parameter of its own (it shares embed_tokens'), so its packed copy keeps the old weights
and every log-prob after the reload comes from the old head. Re-packing every embedding-type
layer from its (shared, freshly loaded) weight after the reload makes the served model equal
to the one on disk.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

API_KEY_ENV = "AREAL_API_KEY"
"""Same name as areal.rollout.auth.API_KEY_ENV (not imported: see the module docstring)."""
WEIGHT_VERSION_ENV = "AREAL_WEIGHT_VERSION"
"""The weight version a server starts with (StartWeightVersion)."""
WEIGHTS_ROOTS_ENV = "AREAL_WEIGHTS_ROOTS"
"""os.pathsep-separated directories weights may be reloaded from (unset: anywhere)."""
_OPEN_PATHS = ("/health", "/metrics")


class RequireAPIKey:
    """ASGI middleware (`--middleware areal.rollout.vllm_ext.RequireAPIKey`): 401 for any
    request without `Authorization: Bearer $AREAL_API_KEY`, bar /health and /metrics."""

    def __init__(self, app: Callable) -> None:
        key = os.environ.get(API_KEY_ENV)
        if not key:
            raise RuntimeError(
                f"--middleware areal.rollout.vllm_ext.RequireAPIKey needs the key in ${API_KEY_ENV}"
            )
        self.app = app
        self._expected = hashlib.sha256(f"Bearer {key}".encode()).digest()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if scope["path"].startswith(_OPEN_PATHS):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(hashlib.sha256(given).digest(), self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": {"message": "Unauthorized"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class StartWeightVersion:
    """ASGI middleware (`--middleware areal.rollout.vllm_ext.StartWeightVersion`): the weight
    version the server reports until the first update is $AREAL_WEIGHT_VERSION, not vLLM's
    "default" (SGLang's --weight-version; vLLM has no such flag). Set before the first request
    (a /health probe included) is answered, so no output is ever tagged with "default"."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self._version = os.environ.get(WEIGHT_VERSION_ENV)
        self._done = self._version is None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not self._done and scope["type"] == "http":
            # vLLM keeps its engine client on the app's state (every router reads it there).
            await scope["app"].state.engine_client.update_weight_version(self._version)
            self._done = True
        return await self.app(scope, receive, send)


def weights_path_problem(path: str) -> str | None:
    """None if `path` is a weight directory under one of $AREAL_WEIGHTS_ROOTS (anywhere when
    unset), else why not. Checked before vLLM starts a reload: a reload that fails half way
    leaves the model half loaded, and the engine dies at its next step."""
    roots = [r for r in os.environ.get(WEIGHTS_ROOTS_ENV, "").split(os.pathsep) if r]
    real = Path(path).resolve()
    if roots and not any(real.is_relative_to(Path(r).resolve()) for r in roots):
        return f"{path} is not under any directory this server loads weights from ({roots})"
    if not (real / "config.json").is_file() or not any(real.glob("*.safetensors")):
        return f"{path} is not a weight directory (config.json and *.safetensors)"
    return None


class AReaLWorker:
    """Mixed into vLLM's worker class; methods are called by name through /collective_rpc."""

    def areal_reload_weights(self, weights_path: str) -> int:
        """Load weights_path (an HF directory) in place; returns how many layers were re-packed."""
        problem = weights_path_problem(weights_path)
        if problem:
            raise ValueError(problem)
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return self.areal_repack_embeddings()

    @torch.inference_mode()
    def areal_repack_embeddings(self) -> int:
        """Re-pack the CPU GEMM copy of every embedding-type layer (the LM head included)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0  # GPU layers read their weight directly: nothing is packed apart
        n = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
                method.process_weights_after_loading(module)
                n += 1
        return n
