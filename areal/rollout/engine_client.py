"""EngineClient: the InferenceClient (inference.py) of a DecodeEngine in this process.

```
 rollout worker ──generate_batch──► EngineClient ──sglang_api builders/parsers──► DecodeEngine
   (worker.py)  ◄─GenerateOutput──  (no HTTP)    ◄─format_generate_output───────  (engine.py)
```

What the embedded server (server.py) does for an HTTP request, without the HTTP: the body
goes through the same sglang_api builder and parser, the engine's result through the same
formatter and response parser, so the worker sees exactly what SGLangClient would give it.
Used by the in-process run (areal/inline.py). The engine is the caller's: close() leaves it
running. A blocking engine call (pause, a weight update, a weight-update group's collective)
runs in a worker thread, as the server runs it.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from typing import Any

from areal.rollout import sglang_api as api
from areal.rollout.engine import DecodeEngine
from areal.rollout.http_error import BadRequest
from areal.rollout.inference import GenerateOutput


class EngineClient:
    """Async calls to one DecodeEngine; an InferenceClient and a WeightGroupClient."""

    def __init__(
        self,
        engine: DecodeEngine,
        base_url: str = "inline://engine0",
        weights_group_timeout_s: float = 120.0,
    ) -> None:
        self.engine = engine
        self.base_url = base_url
        self.weights_group_timeout_s = weights_group_timeout_s
        """How long a weight-update group waits for its peers (the server's
        --weights-group-timeout-s)."""

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        body = api.build_batch_generate_request(input_ids, sampling_params, rids)
        tokenizer = self.engine.tokenizer
        try:
            specs, _ = api.parse_generate_body(body, tokenizer)
        except BadRequest as e:  # what the server answers with a 400
            raise RuntimeError(f"{self.base_url} refused the request: {e}") from None
        futures = []
        try:
            for spec in specs:
                futures.append(
                    asyncio.wrap_future(self.engine.submit(spec.rid, spec.input_ids, spec.params))
                )
        except ValueError as e:
            for spec in specs[: len(futures)]:
                self.engine.abort(rid=spec.rid)
            raise RuntimeError(f"{self.base_url} refused the request: {e}") from None
        try:
            # Shielded: cancelling the caller must abort the requests, not cancel the
            # engine's futures (the engine resolves each once it finishes).
            results = await asyncio.shield(asyncio.gather(*futures))
        except asyncio.CancelledError:
            for spec in specs:
                self.engine.abort(rid=spec.rid, message="The client went away.")
            raise
        outputs = [
            api.format_generate_output(r, spec, tokenizer)
            for r, spec in zip(results, specs, strict=True)
        ]
        return api.parse_batch_generate_response(outputs, len(input_ids))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        result = await asyncio.to_thread(
            self.engine.update_weights, model_path, weight_version, abort_all_requests
        )
        body, _ = api.format_update_weights_response(*result)
        problem = api.update_weights_problem(body)
        if problem is not None:
            raise RuntimeError(f"{self.base_url} refused weights {model_path}: {problem}")
        return body

    async def pause_generation(self, mode: str = "abort") -> dict:
        try:
            mode = api.parse_pause_body(api.build_pause_request(mode))
        except BadRequest as e:
            raise RuntimeError(f"{self.base_url} refused to pause: {e}") from None
        await asyncio.to_thread(self.engine.pause, mode)
        return api.format_pause_response()

    async def continue_generation(self) -> dict:
        await asyncio.to_thread(self.engine.continue_generation)
        return api.format_continue_response()

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = api.DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        body = api.build_init_weights_group_request(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        spec = self._parsed(api.parse_init_weights_group_body, body)
        result = await asyncio.to_thread(
            self.engine.init_weights_update_group,
            spec.master_address,
            spec.master_port,
            spec.rank_offset,
            spec.world_size,
            spec.group_name,
            spec.backend,
            self.weights_group_timeout_s,
        )
        return self._answer(result, f"refused to join weight-update group {group_name}")

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
        body = api.build_update_weights_from_distributed_request(
            names,
            dtypes,
            shapes,
            group_name,
            weight_version,
            abort_all_requests,
            load_format,
            flush_cache,
            lora_config,
        )
        spec = self._parsed(api.parse_update_weights_from_distributed_body, body)
        result = await asyncio.to_thread(
            self.engine.update_weights_from_distributed,
            spec.names,
            spec.dtypes,
            spec.shapes,
            spec.group_name,
            spec.weight_version,
            spec.abort_all_requests,
            spec.load_format,
            spec.lora_config,
        )
        return self._answer(
            result, f"refused weights (version {weight_version}) over group {group_name}"
        )

    async def destroy_weights_update_group(
        self, group_name: str = api.DEFAULT_GROUP_NAME
    ) -> dict[str, Any]:
        result = await asyncio.to_thread(self.engine.destroy_weights_update_group, group_name)
        return self._answer(result, f"could not destroy weight-update group {group_name}")

    def _parsed(self, parse: Callable[[dict], Any], body: dict) -> Any:
        """The server's parse of a request body; what it answers with a 400, a RuntimeError."""
        try:
            return parse(body)
        except BadRequest as e:
            raise RuntimeError(f"{self.base_url} refused the request: {e}") from None

    def _answer(self, result: tuple[bool, str], what: str) -> dict[str, Any]:
        body, _ = api.format_success_response(*result)
        problem = api.success_problem(body)
        if problem is not None:
            raise RuntimeError(f"{self.base_url} {what}: {problem}")
        return body

    async def abort_request(self, rid: str) -> None:
        self.engine.abort(rid=rid)

    async def health(self) -> bool:
        return self.engine.is_alive()

    async def wait_healthy(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not healthy after {timeout:g} s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Nothing to free: the engine is the caller's."""
