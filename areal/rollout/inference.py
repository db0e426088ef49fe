"""What the rollout worker needs of an inference server: the InferenceClient seam.

```
 RolloutWorker ──InferenceClient──► SGLangClient (client.py) ──SGLang HTTP──► SGLang
   (worker.py)    generate_batch                                         or embedded server
                  update_weights_from_disk                               (server.py)
                  pause_/continue_generation  VLLMClient (vllm_client.py) ──► vLLM
                  abort_request, health,      EngineClient (engine_client.py) ──► DecodeEngine
                  wait_healthy, close
 RolloutWorker ──WeightGroupClient──► SGLangClient, EngineClient (not vLLM's), when
   (weights.transport=distributed)   init_weights_update_group,
                                      update_weights_from_distributed (the trainer sends),
                                      destroy_weights_update_group
```

A client reduces every backend's answer to GenerateOutput (token ids, per-token log-probs,
finish reason, integer weight version), so the worker never sees a wire format. The worker
gets its clients from a ClientFactory (a client's class is one), which the backend of
`inference.backend` gives (areal/rollout/backends/: `load_backend(name).client()`). This
module declares the seam and imports none of its implementations.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(kw_only=True)
class GenerateOutput:
    """One finished (or aborted) request, reduced to what a trajectory needs."""

    output_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each output token."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    weight_version: int
    """The policy version that finished the request (SGLang's "default" reads as 0)."""
    completion_tokens: int
    rid: str | None
    message: str = ""
    """The server's message for an abort."""


class ServerDied(ConnectionError):
    """The server refused, reset or dropped the connection of a call: it is down or died
    mid-request (a malformed answer is a ValueError, an HTTP error a RuntimeError)."""

    def __init__(self, url: str, operation: str, cause: BaseException):
        self.url = url
        self.operation = operation
        super().__init__(
            f"inference server {url} is unreachable or died during {operation} "
            f"({type(cause).__name__}: {cause})"
        )


@runtime_checkable
class InferenceClient(Protocol):
    """Async calls to one inference server, as the rollout worker makes them.

    A call raises ServerDied when the server is unreachable or dies during it, RuntimeError
    when it answers with an error, ValueError when its answer is malformed.
    """

    base_url: str
    """The server's URL (for logs, and to notice that a restarted server moved)."""

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        """Generate for a group's prompts (token ids in) in one round trip; one output per
        prompt, in order. Returns when every request finished or was aborted; an aborted
        one comes back with finish_reason "abort" and its partial output."""
        ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Load the weights in directory model_path and report weight_version from now on;
        RuntimeError when the server refuses them. abort_all_requests: the one-call
        interruption (abort the requests in flight, load, and hold the requests that arrive
        meanwhile until the new weights are in); without it, call on an idle server."""
        ...

    async def pause_generation(self, mode: str = "abort") -> dict:
        """Stop generating until continue_generation(); requests sent meanwhile wait.
        "abort": the requests in flight come back with finish_reason "abort" (partial)."""
        ...

    async def continue_generation(self) -> dict:
        """Generate again: the waiting requests run (on the weights loaded meanwhile)."""
        ...

    async def abort_request(self, rid: str) -> None:
        """Abort one request: its generate call returns with finish_reason "abort"."""
        ...

    async def health(self) -> bool:
        """Whether the server answers and serves (False, never an error, when it is down)."""
        ...

    async def wait_healthy(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Until health(); TimeoutError after timeout seconds, RuntimeError at once if proc
        (the server's process, when known) exits."""
        ...

    async def close(self) -> None:
        """Free the connections (the client may be used again afterwards)."""
        ...


@runtime_checkable
class WeightGroupClient(InferenceClient, Protocol):
    """An InferenceClient whose server takes weights over a weight-update group
    (areal/weight_group.py; SGLang's routes): the trainer, rank 0, broadcasts them while the
    rollout worker makes these calls (weights.transport=distributed). Each call
    returns once the collective it joins is done, so the trainer takes its part (joins,
    sends the bucket) at the same time. RuntimeError with the server's message when it
    refuses or the collective fails."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join group_name (rank 0 serves its store at master_address:master_port) as ranks
        rank_offset.. of world_size; returns once every rank joined."""
        ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        flush_cache: bool = True,
        lora_config: dict | None = None,
    ) -> dict[str, Any]:
        """Receive one bucket of a version (rank 0 broadcasts its tensors in the order of
        names, dtypes as torch's names: "bfloat16") and apply it; report weight_version from
        now on. A refused bucket changes nothing; a failed broadcast leaves the group broken
        (destroy it and form a new one). Usually between pause_generation and
        continue_generation, one call per bucket. load_format "delta": what changed since
        the version the server holds (areal/weight_group.py's encode_delta); "lora": LoRA
        adapter tensors, merged as lora_config says (r, lora_alpha, target_modules;
        sglang_api.LORA). flush_cache: the version's last bucket (a server may hold the
        others until it comes: vLLM)."""
        ...

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        """Leave and free the group (a broken one too)."""
        ...


class ClientFactory(Protocol):
    """Makes the client of the server at base_url (a client class is one)."""

    def __call__(self, base_url: str, *, api_key: str | None = None) -> InferenceClient: ...
