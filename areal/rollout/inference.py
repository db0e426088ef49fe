"""What the rollout worker needs of an inference server: the InferenceClient seam.

```
 RolloutWorker ──InferenceClient──► SGLangClient (client.py) ──SGLang HTTP──► SGLang
   (worker.py)    generate_batch                                         or embedded server
                  update_weights_from_disk                               (server.py)
                  abort_request, health,      VLLMClient (vllm_client.py) ──► vLLM
                  wait_healthy, close
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


class ClientFactory(Protocol):
    """Makes the client of the server at base_url (a client class is one)."""

    def __call__(self, base_url: str, *, api_key: str | None = None) -> InferenceClient: ...
