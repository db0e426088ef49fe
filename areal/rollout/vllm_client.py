"""The rollout worker's client for a vLLM server: SGLangClient's methods, on vLLM's routes.

```
 rollout worker ── build_generate_request() ──► VLLMClient ──POST /inference/v1/generate──► vLLM
  (SGLang-shaped  ◄─ parse_generate_response() ◄──────────── JSON ◄─────────────────────────
   sampling params)
 update_weights_from_disk(dir, v, abort_all_requests)
      POST /pause?mode=abort|wait ─► /collective_rpc areal_reload_weights ─► /update_weight_version
      ─► /reset_prefix_cache ─► /resume            (always resumed, even when a step failed)
 update_weights_from_disk(adapter dir, v, ...)     (model.lora: the server runs --enable-lora)
      new sends wait ─► POST /pause ─► /abort_requests until every request sent is back ─►
      /v1/load_lora_adapter {areal-lora-vN} ─► /update_weight_version ─► /reset_prefix_cache
      ─► /resume ─► later requests name areal-lora-vN ─► /v1/unload_lora_adapter {the previous}
```

The protocol (requests, answers, where vLLM differs from SGLang) is vllm_api.py's plain
functions; VLLMClient is the thin I/O layer on one aiohttp session. The worker cannot tell it
from SGLangClient: same method names and arguments, the same GenerateOutput, the same errors
(ServerDied when the connection fails, RuntimeError with the server's message for an HTTP
error, ValueError for a malformed answer).

| call                        | waits for                       | unblocked by                   |
|-----------------------------|---------------------------------|--------------------------------|
| generate / generate_batch   | every request's answer          | finish, abort, pause (abort)   |
| a request sent while paused | vLLM's queue                    | /resume, after the new weights |
| update_weights_from_disk    | /pause (aborted answers go out  | the engine emptying its batch  |
|                             | before it answers)              |                                |
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal.rollout.client import adapter_name
from areal.rollout.http_client import AdapterGate, HttpClient
from areal.rollout.inference import GenerateOutput
from areal.rollout.sglang_api import format_weight_version, parse_weight_version
from areal.rollout.vllm_api import (
    GAUGES,
    GENERATE_PATH,
    GROUP_METHODS,
    RELOAD_METHOD,
    build_generate_request,
    build_load_adapter_request,
    engine_request_id,
    parse_collective_rpc,
    parse_generate_response,
    parse_metrics,
)
from areal.weights import is_adapter_dir


class VLLMClient(HttpClient):
    """Async calls to one vLLM server; one aiohttp session per client and event loop."""

    def __init__(self, base_url: str, timeout: float = 3600, api_key: str | None = None) -> None:
        super().__init__(base_url, timeout, api_key)
        self.weight_version = 0
        """The last version this client loaded or set (tags outputs without tokens)."""
        self.lora = AdapterGate()
        """The LoRA adapter the requests name (model.lora; None: the base model)."""

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput:
        if int(sampling_params.get("max_new_tokens", 1)) <= 0:
            # SGLang answers "length" with no tokens; vLLM refuses max_tokens=0.
            return GenerateOutput(
                output_ids=[], logprobs=[], finish_reason="length",
                weight_version=self.weight_version, completion_tokens=0, rid=rid,
            )  # fmt: skip
        async with self.lora.sending() as adapter:
            body = build_generate_request(input_ids, sampling_params, rid, adapter)
            result = await self._call("POST", GENERATE_PATH, body)
        return parse_generate_response(result, self.weight_version)

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        """Several prompts, one request each, sent concurrently (vLLM has no batched form);
        each output as `generate` would return it, in the order of input_ids."""
        if not input_ids or any(not ids for ids in input_ids):
            raise ValueError("input_ids must not be empty")
        if not len(input_ids) == len(sampling_params) == len(rids):
            raise ValueError("input_ids, sampling_params and rids must have the same length")
        calls = [
            self.generate(i, p, r) for i, p, r in zip(input_ids, sampling_params, rids, strict=True)
        ]
        return list(await asyncio.gather(*calls))

    async def pause_generation(self, mode: str = "abort") -> dict:
        """ "abort": in-flight requests come back with finish_reason "abort" before this
        answers; "wait": they finish first. New requests wait in vLLM's queue until resumed."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep, got {mode!r}")
        return await self._call("POST", f"/pause?mode={mode}", None)

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/resume", None)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = False
    ) -> dict:
        """Serve the weights in model_path as weight_version. With abort_all_requests the
        in-flight requests come back at once, partial, finish_reason "abort"; without, they
        finish first. Requests sent meanwhile wait and run with the new weights. Nothing
        computed with the old weights is reused (the prefix cache is emptied). RuntimeError
        with the server's message when it refuses; the server is resumed either way."""
        if is_adapter_dir(model_path):
            return await self._load_adapter(str(model_path), weight_version, abort_all_requests)
        mode = "abort" if abort_all_requests else "wait"
        await self._call("POST", f"/pause?mode={mode}", None)
        try:
            rpc = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(model_path)}}
            try:
                parse_collective_rpc(await self._call("POST", "/collective_rpc", rpc))
            except RuntimeError as e:
                raise RuntimeError(f"{self.base_url} refused weights {model_path}: {e}") from e
            await self.set_weight_version(weight_version)
            await self._call("POST", "/reset_prefix_cache", None)
        finally:
            await self._call("POST", "/resume", None)
        return {"success": True, "message": f"loaded {model_path}", "num_paused_requests": 0}

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join the weight-update group (each of the server's workers as rank_offset + its
        tp rank); answers once every rank joined. RuntimeError when it fails."""
        kwargs = dict(master_address=master_address, master_port=master_port,
                      rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                      backend=backend)  # fmt: skip
        results = await self._group_rpc(
            GROUP_METHODS[0], kwargs, f"could not join weight-update group {group_name}"
        )
        return {"success": True, "message": results[0]}

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
        """Receive one bucket that rank 0 broadcasts meanwhile. The server holds the buckets
        of a version and loads them with the last one (flush_cache), then serves
        weight_version with an empty prefix cache. Pause first (the rollout worker does):
        the load runs between engine steps, and a request that spans it would mix versions.
        RuntimeError when the server refuses the version (nothing loaded) or the broadcast
        fails."""
        if load_format is not None or lora_config is not None:
            # Adapters reach vLLM by path (/v1/load_lora_adapter): config.py refuses LoRA
            # over the group with vLLM.
            raise ValueError(f"load_format {load_format!r}: vLLM's servers take whole tensors")
        if abort_all_requests:
            await self.abort_request(abort_all=True)
        kwargs = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                      weight_version=format_weight_version(weight_version),
                      apply=bool(flush_cache))  # fmt: skip
        what = f"refused weights (version {weight_version}) over group {group_name}"
        await self._group_rpc(GROUP_METHODS[1], kwargs, what)
        if flush_cache:
            await self.set_weight_version(weight_version)
            await self._call("POST", "/reset_prefix_cache", None)
        return {"success": True, "message": f"received {len(names)} tensors"}

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        """Leave the weight-update group (a broken one too)."""
        results = await self._group_rpc(
            GROUP_METHODS[2], {}, f"could not leave weight-update group {group_name}"
        )
        return {"success": True, "message": results[0]}

    async def _group_rpc(self, method: str, kwargs: dict, what: str) -> list[Any]:
        """/collective_rpc of a weight-update group method (areal/rollout/vllm_ext.py);
        RuntimeError "<server> <what>: <its message>"."""
        rpc = {"method": method, "kwargs": kwargs}
        try:
            return parse_collective_rpc(await self._call("POST", "/collective_rpc", rpc))
        except RuntimeError as e:
            raise RuntimeError(f"{self.base_url} {what}: {e}") from e

    async def _load_adapter(self, path: str, version: int, abort_all_requests: bool) -> dict:
        """Serve the LoRA adapter at path as `version` (module docstring: the order)."""
        name = adapter_name(version)
        async with self.lora.swapping():
            await self._call("POST", f"/pause?mode={'abort' if abort_all_requests else 'wait'}",
                             None)  # fmt: skip
            try:
                # A request that reached the server during the pause still names the old
                # adapter: abort until each one sent has answered.
                await self.lora.drain(lambda: self._call("POST", "/abort_requests", {}))
                try:
                    await self._call("POST", "/v1/load_lora_adapter",
                                     build_load_adapter_request(name, path))  # fmt: skip
                except RuntimeError as e:
                    raise RuntimeError(f"{self.base_url} refused adapter {path}: {e}") from e
                await self.set_weight_version(version)
                await self._call("POST", "/reset_prefix_cache", None)
                previous, self.lora.adapter = self.lora.adapter, name
            finally:
                await self._call("POST", "/resume", None)
        if previous not in (None, name):
            # No request names it any more (new ones name `name`). A restarted server never
            # had it: 404, fine.
            try:
                await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": previous},
                                 ok_statuses=(200, 404))  # fmt: skip
            except RuntimeError:
                pass  # only memory: the server keeps serving `name`
        return {"success": True, "message": f"loaded adapter {path} as {name}",
                "num_paused_requests": 0}  # fmt: skip

    async def set_weight_version(self, weight_version: int) -> None:
        """Label what the server generates from now on (no weights change)."""
        body = {"new_version": format_weight_version(weight_version)}
        await self._call("POST", "/update_weight_version", body)
        self.weight_version = weight_version

    async def get_weight_version(self) -> int:
        body = await self._call("GET", "/weight_info", None)
        return parse_weight_version((body or {}).get("weight_version"))

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort the request sent with rid (it answers with finish_reason "abort"), or all."""
        if abort_all:
            body: dict[str, Any] = {}  # vLLM: no ids aborts everything in flight
        elif rid:
            body = {"request_ids": [engine_request_id(rid)]}
        else:
            raise ValueError("abort_request needs a rid or abort_all=True")
        await self._call("POST", "/abort_requests", body)

    async def flush_cache(self) -> dict:
        return await self._call("POST", "/reset_prefix_cache", None)

    async def model_info(self) -> dict:
        """SGLang's /model_info fields that vLLM has: model_path and weight_version."""
        models = await self._call("GET", "/v1/models", None)
        version = await self._call("GET", "/weight_info", None)
        data = (models or {}).get("data") or [{}]
        return {
            "model_path": data[0].get("root", data[0].get("id")),
            "is_generation": True,
            "weight_version": (version or {}).get("weight_version"),
        }

    async def server_info(self) -> dict:
        """Load and state: num_running_reqs and num_waiting_reqs (the engine's, from /metrics),
        num_http_requests (requests being answered, from /load), is_paused, weight_version
        and version (vLLM's)."""
        load = await self._call("GET", "/load", None)
        metrics = await self._call("GET", "/metrics", None)
        paused = await self._call("GET", "/is_paused", None)
        weights = await self._call("GET", "/weight_info", None)
        version = await self._call("GET", "/version", None)
        gauges = parse_metrics(str(metrics), GAUGES)
        return {
            "num_running_reqs": int(gauges["vllm:num_requests_running"]),
            "num_waiting_reqs": int(gauges["vllm:num_requests_waiting"]),
            "num_http_requests": int((load or {}).get("server_load", 0)),
            "is_paused": bool((paused or {}).get("is_paused")),
            "weight_version": (weights or {}).get("weight_version"),
            "version": (version or {}).get("version"),
        }
