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

Weights over a weight-update group (weights.transport=distributed; areal/weight_group.py,
the repository's module, which imports only torch):

```
 VLLMClient.init_weights_update_group ──/collective_rpc areal_init_weights_group──► join
 VLLMClient.update_weights_from_distributed (one bucket) ──areal_receive_weights──► receive,
        hold on the CPU; the version's last bucket (flush_cache) ──► check, reload, re-pack
 VLLMClient.destroy_weights_update_group ──areal_destroy_weights_group──► leave, drop held
```

A version is applied whole, once its last bucket has arrived: vLLM's in-place reload
restores every layer it loads from scratch, so a layer whose tensors were split over two
buckets (q_proj in one, k_proj in the next: one qkv_proj here) cannot be loaded half. Each
worker of a tensor-parallel server joins as rank_offset + its tp rank and receives every
tensor (the reload shards them). Names and shapes are checked against the server's
checkpoint before anything is loaded: a bad version changes nothing.

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
GROUP_TIMEOUT_ENV = "AREAL_WEIGHTS_GROUP_TIMEOUT_S"
"""Seconds any collective of a weight-update group may take (weights.timeout_s)."""
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

    # ---- weights over a weight-update group (module docstring) ----------------------------

    def areal_init_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> str:
        """Join group_name as rank_offset + this worker's tp rank (leaving any group before);
        returns once every rank has joined, or raises after $AREAL_WEIGHTS_GROUP_TIMEOUT_S."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from areal import weight_group

        self.areal_destroy_weights_group()
        rank = rank_offset + get_tensor_model_parallel_rank()
        # Received tensors land where the group's collectives run.
        cuda = backend == "nccl"
        self._areal_device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self._areal_group = weight_group.open_group(
            backend=backend,
            master_address=master_address,
            master_port=int(master_port),
            rank=rank,
            world_size=int(world_size),
            group_name=group_name,
            timeout_s=float(os.environ.get(GROUP_TIMEOUT_ENV, "120")),
        )
        return f"joined weight-update group {group_name} as rank {rank} of {world_size}"

    def areal_receive_weights(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str,
        apply: bool,
    ) -> int:
        """Receive one bucket of weight_version (rank 0 broadcasts it meanwhile) and hold it;
        with `apply` (the version's last bucket) load every held tensor. Returns how many
        tensors are held (0 once applied). A bucket of another version than the one held
        starts over (the held one's broadcast failed). ValueError, nothing loaded, for a
        name or shape the checkpoint does not have, or a version missing tensors."""
        from areal import weight_group

        group = getattr(self, "_areal_group", None)
        if group is None or group.name != group_name:
            raise ValueError(f"this server is not in weight-update group {group_name}")
        received = weight_group.receive(group, names, dtypes, shapes, self._areal_device)
        held = getattr(self, "_areal_held", None)
        if held is None or held[0] != weight_version:
            held = self._areal_held = (weight_version, {})
        # Off the accelerator until the version is complete: a second copy of the model there
        # could leave no room for the KV cache.
        # (A shm group's tensors are views of a slot the next bucket may reuse: copies.)
        copy = group.backend == "shm"
        held[1].update((name, t.to("cpu", copy=copy)) for name, t in received.items())
        expected = self._areal_checkpoint_shapes()
        problems = [
            f"unexpected tensor {name}" if name not in expected else
            f"tensor {name} has shape {list(t.shape)}, the model expects {expected[name]}"
            for name, t in received.items()
            if expected.get(name) != list(t.shape)
        ]  # fmt: skip
        if apply:
            problems += [f"missing tensor {name}" for name in expected if name not in held[1]]
        if problems:
            self._areal_held = None
            raise ValueError(f"version {weight_version} refused: " + "; ".join(problems[:5]))
        if not apply:
            return len(held[1])
        self._areal_held = None
        self.reload_weights(weights_iterator=iter(held[1].items()), is_checkpoint_format=True)
        self.areal_repack_embeddings()
        return 0

    def areal_destroy_weights_group(self) -> str:
        """Leave the weight-update group (a broken one too) and drop what is held."""
        group, self._areal_group, self._areal_held = getattr(self, "_areal_group", None), None, None
        if group is None:
            return "not in a weight-update group"
        group.close()
        return f"left weight-update group {group.name}"

    def _areal_checkpoint_shapes(self) -> dict[str, list[int]]:
        """The tensors of the checkpoint the server started from (names as the trainer sends
        them: HF's, tied ones once) and their shapes, read from the safetensors headers."""
        shapes = getattr(self, "_areal_shapes", None)
        if shapes is None:
            from safetensors import safe_open

            shapes = {}
            for file in sorted(Path(self.vllm_config.model_config.model).glob("*.safetensors")):
                with safe_open(str(file), "pt") as f:
                    shapes.update((k, list(f.get_slice(k).get_shape())) for k in f.keys())
            if not shapes:
                raise ValueError(
                    f"no *.safetensors in {self.vllm_config.model_config.model}: this server "
                    "cannot check a version's names and shapes"
                )
            self._areal_shapes = shapes
        return shapes
