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
"""

from __future__ import annotations

from typing import Any

from areal.rollout import sglang_api as api
from areal.rollout.http_client import HttpClient
from areal.rollout.inference import GenerateOutput


class SGLangClient(HttpClient):
    """Async calls to one SGLang-API server; one aiohttp session per client and event loop.

    An InferenceClient (areal/rollout/inference.py), plus SGLang's other calls for tests,
    eval and benchmarks (generate, pause/continue_generation, flush_cache, model_info,
    server_info)."""

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput:
        body = api.build_generate_request(input_ids, sampling_params, rid)
        return api.parse_generate_response(await self._call("POST", "/generate", body))

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        """Several prompts in one /generate (SGLang's batch form): one HTTP round trip for
        a group instead of one per sample; each output as `generate` would return it."""
        body = api.build_batch_generate_request(input_ids, sampling_params, rids)
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
        body = api.build_update_weights_request(model_path, weight_version, abort_all_requests)
        result = await self._call("POST", "/update_weights_from_disk", body, ok_statuses=(200, 400))
        problem = api.update_weights_problem(result)
        if problem is not None:
            raise RuntimeError(f"{self.base_url} refused weights {model_path}: {problem}")
        return result

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
