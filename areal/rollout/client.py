"""SGLangClient: the InferenceClient (inference.py) for SGLang's HTTP API, spoken by SGLang
itself and by the embedded server.

```
 rollout worker ──generate_batch──► SGLangClient ──build_*_request──► POST /generate ──► server
   (worker.py)  ◄─GenerateOutput──  (this: I/O)  ◄─parse_*_response── JSON ◄───────────
```

The contract (request builders, response parsers, the weight-version reader) is plain
functions in sglang_api.py, tested without a server; this is the thin I/O layer on one aiohttp
session, made lazily inside the running event loop. A call waits only for its HTTP answer:
/generate returns when the request finishes or is aborted (by abort_request,
pause_generation(mode="abort") or update_weights_from_disk(abort_all_requests=True)), and an
aborted request comes back as a normal result with finish_reason "abort" and its partial
output, which the worker resumes.

| a call waits for                    | unblocked by                                       |
|-------------------------------------|----------------------------------------------------|
| its HTTP answer                     | the server's answer; ServerDied if it goes away    |
| generate: its requests' end         | stop/length, or an abort (any of the three above)  |
| wait_healthy: /health answering 200 | the server up; TimeoutError; its process exiting   |

Weights over a weight-update group (areal/weight_group.py): init_weights_update_group,
update_weights_from_distributed (one bucket per call) and destroy_weights_update_group each
return while the trainer, rank 0, takes its part in the same collective (joins, broadcasts
the bucket): the caller runs both at once and bounds them with its own deadline; the server
bounds every wait with its group timeout.

LoRA (model.lora): a version is an adapter directory. The embedded server loads it through
/update_weights_from_disk like any version (it merges it into its weights). SGLang serves
adapters by name (SGLangServerClient, the sglang backend's client): each version's adapter
is loaded under its own name and the requests that follow name it in "lora_path":

    new sends wait ─► /pause_generation {abort} ─► /abort_request {abort_all} until every
    request sent is back ─► /load_lora_adapter {areal-lora-vN} ─► /update_weight_version ─►
    /continue_generation ─► later requests name areal-lora-vN ─► /unload_lora_adapter {old}
"""

from __future__ import annotations

from typing import Any, ClassVar

from areal.rollout import sglang_api as api
from areal.rollout.http_client import AdapterGate, HttpClient
from areal.rollout.inference import GenerateOutput
from areal.weights import is_adapter_dir

ADAPTER_NAME_PREFIX = "areal-lora-v"


def adapter_name(version: int) -> str:
    """The name a version's adapter is served under (one per version, as on vLLM)."""
    return f"{ADAPTER_NAME_PREFIX}{version:06d}"


class SGLangClient(HttpClient):
    """Async calls to one SGLang-API server; one aiohttp session per client and event loop.

    An InferenceClient (areal/rollout/inference.py), plus SGLang's other calls for tests,
    eval and benchmarks (generate, pause/continue_generation, flush_cache, model_info,
    server_info)."""

    adapters_by_name: ClassVar[bool] = False
    """Whether adapter versions load by name (SGLang's LoRA routes) rather than through
    /update_weights_from_disk (the embedded server)."""

    def __init__(self, base_url: str, timeout: float = 3600, api_key: str | None = None) -> None:
        super().__init__(base_url, timeout, api_key)
        self.lora = AdapterGate()
        """The adapter the requests name (adapters_by_name; None: the base model)."""

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput:
        async with self.lora.sending() as adapter:
            body = api.with_lora_path(
                api.build_generate_request(input_ids, sampling_params, rid), adapter
            )
            result = await self._call("POST", "/generate", body)
        return api.parse_generate_response(result)

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        """Several prompts in one /generate (SGLang's batch form): one HTTP round trip for
        a group instead of one per sample; each output as `generate` would return it."""
        async with self.lora.sending() as adapter:
            body = api.with_lora_path(
                api.build_batch_generate_request(input_ids, sampling_params, rids), adapter
            )
            result = await self._call("POST", "/generate", body)
        return api.parse_batch_generate_response(result, len(input_ids))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._call("POST", "/pause_generation", api.build_pause_request(mode))

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Load new weights; RuntimeError with the server's message when it refuses."""
        if self.adapters_by_name and is_adapter_dir(model_path):
            return await self._load_adapter(str(model_path), weight_version, abort_all_requests)
        body = api.build_update_weights_request(model_path, weight_version, abort_all_requests)
        result = await self._call("POST", "/update_weights_from_disk", body, ok_statuses=(200, 400))
        problem = api.update_weights_problem(result)
        if problem is not None:
            raise RuntimeError(f"{self.base_url} refused weights {model_path}: {problem}")
        return result

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = api.DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join the group whose rank 0 serves its store at master_address:master_port, as
        ranks rank_offset..; answers once every rank joined. RuntimeError with the server's
        message when it refuses or fails to join."""
        body = api.build_init_weights_group_request(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return await self._weights_call(
            "/init_weights_update_group", body, f"refused to join weight-update group {group_name}"
        )

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
        """Receive one bucket (names, dtypes, shapes) that rank 0 broadcasts meanwhile, one
        tensor at a time in the order of names; report weight_version once applied.
        load_format "delta": the bucket holds deltas (areal/weight_group.py); "lora": LoRA
        adapter tensors, applied as lora_config says (sglang_api.LORA); the embedded server
        only. RuntimeError with the server's message when it refuses the bucket
        (then the model is unchanged) or the broadcast fails."""
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
        return await self._weights_call(
            "/update_weights_from_distributed",
            body,
            f"refused weights (version {weight_version}) over group {group_name}",
        )

    async def destroy_weights_update_group(
        self, group_name: str = api.DEFAULT_GROUP_NAME
    ) -> dict[str, Any]:
        """Leave the group (a broken one too); RuntimeError when the server has no such group."""
        body = api.build_destroy_weights_group_request(group_name)
        return await self._weights_call(
            "/destroy_weights_update_group",
            body,
            f"could not destroy weight-update group {group_name}",
        )

    async def _weights_call(self, path: str, body: dict, what: str) -> dict[str, Any]:
        """A weight-update group route: its {"success", "message"} answer; RuntimeError with
        the message when success is false (HTTP 400, or a malformed request's error body).
        Bounded by the client's timeout only: the caller sets its own deadline."""
        result = await self._call("POST", path, body, ok_statuses=(200, 400))
        problem = api.success_problem(result)
        if problem is not None:
            raise RuntimeError(f"{self.base_url} {what}: {problem}")
        return result

    async def _load_adapter(self, path: str, version: int, abort_all_requests: bool) -> dict:
        """Serve the adapter at path as `version` (the module docstring's order)."""
        name = adapter_name(version)
        async with self.lora.swapping():
            await self.pause_generation("abort" if abort_all_requests else "in_place")
            try:
                await self.lora.drain(lambda: self.abort_request(abort_all=True))
                body = api.build_load_lora_request(name, path)
                result = await self._call("POST", "/load_lora_adapter", body,
                                          ok_statuses=(200, 400))  # fmt: skip
                problem = api.load_lora_problem(result, name)
                if problem is not None:
                    raise RuntimeError(f"{self.base_url} refused adapter {path}: {problem}")
                body = api.build_update_weight_version_request(version)
                await self._call("POST", "/update_weight_version", body)
                previous, self.lora.adapter = self.lora.adapter, name
            finally:
                await self.continue_generation()
        if previous not in (None, name):  # no request names it any more
            try:
                await self._call("POST", "/unload_lora_adapter",
                                 api.build_unload_lora_request(previous),
                                 ok_statuses=(200, 400, 404))  # fmt: skip
            except RuntimeError:
                pass  # only memory: the server serves `name`
        return {"success": True, "message": f"loaded adapter {path} as {name}",
                "num_paused_requests": 0}  # fmt: skip

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", api.build_abort_request(rid, abort_all))

    async def flush_cache(self) -> str:
        return await self._call("POST", "/flush_cache", None)

    async def model_info(self) -> dict:
        try:
            return await self._call("GET", "/model_info", None)
        except RuntimeError as e:  # SGLang before 0.5 only has /get_model_info
            if "HTTP 404" not in str(e):
                raise
            return await self._call("GET", "/get_model_info", None)

    async def server_info(self) -> dict:
        """Load and counters: SGLang's /get_server_info (the embedded server's has the same
        name and its own counters, e.g. num_running_reqs and total_generated_tokens)."""
        return await self._call("GET", "/get_server_info", None)


class SGLangServerClient(SGLangClient):
    """The client of an SGLang server (inference.backend=sglang): LoRA versions by name."""

    adapters_by_name = True
