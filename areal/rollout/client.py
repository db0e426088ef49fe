"""The rollout worker's client for SGLang's HTTP API (SGLang itself or the embedded server).

```
 rollout worker ── build_generate_request() ──► SGLangClient ──POST /generate──► server
                ◄── parse_generate_response() ◄──────────── JSON ◄──────────────
```

Protocol code is plain functions, tested without a server; SGLangClient is the thin I/O layer
on one aiohttp session, made lazily inside the running event loop. A call waits only for its
HTTP answer: /generate returns when the request finishes or is aborted (by abort_request,
pause_generation(mode="abort") or update_weights_from_disk(abort_all_requests=True)), and an
aborted request comes back as a normal result with finish_reason "abort" and its partial
output, which the worker resumes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from areal.rollout.auth import auth_header

FINISH_REASONS = ("stop", "length", "abort")


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


@dataclass(kw_only=True)
class GenerateOutput:
    """One /generate result, reduced to what a trajectory needs."""

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


def build_generate_request(
    input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
) -> dict[str, Any]:
    """The /generate body for one prompt: token ids in, token ids and log-probs out."""
    if not input_ids:
        raise ValueError("input_ids must not be empty")
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling_params),
        "return_logprob": True,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    return body


def parse_weight_version(value: Any) -> int:
    """SGLang reports weight_version as a string; ours are integers ("default" is 0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text == "default":
            return 0
        text = text[1:] if text[:1] in ("v", "V") else text
        if text.isdigit():
            return int(text)
    raise ValueError(f"meta_info.weight_version {value!r} is not an integer version")


def parse_generate_response(body: Any) -> GenerateOutput:
    """GenerateOutput from a /generate response; ValueError names the missing field."""
    if not isinstance(body, dict):
        raise ValueError(f"the /generate response must be a JSON object, got {type(body).__name__}")
    output_ids = _field(body, "output_ids", list, "")
    meta = _field(body, "meta_info", dict, "")
    reason = _field(meta, "finish_reason", dict, "meta_info.")
    kind = _field(reason, "type", str, "meta_info.finish_reason.")
    if kind not in FINISH_REASONS:
        raise ValueError(f"meta_info.finish_reason.type {kind!r} is not one of {FINISH_REASONS}")
    if "weight_version" not in meta:
        raise ValueError("the /generate response has no field meta_info.weight_version")
    entries = _field(meta, "output_token_logprobs", list, "meta_info.")
    if len(entries) != len(output_ids):
        raise ValueError(
            f"meta_info.output_token_logprobs has {len(entries)} entries "
            f"for {len(output_ids)} output_ids"
        )
    logprobs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != output_ids[i]:
            raise ValueError(
                f"meta_info.output_token_logprobs[{i}] is not [logprob, {output_ids[i]}, ...]"
            )
        logprobs.append(float(entry[0]))
    return GenerateOutput(
        output_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=parse_weight_version(meta["weight_version"]),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        rid=meta.get("id"),
        message=str(reason.get("message", "")) if kind == "abort" else "",
    )


def error_message(body: Any) -> str:
    """The message inside an SGLang error body ({"error": {"message"}} or {"message"})."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)


def _field(obj: dict, key: str, kind: type, prefix: str) -> Any:
    if key not in obj or obj[key] is None:
        raise ValueError(f"the /generate response has no field {prefix}{key}")
    if not isinstance(obj[key], kind):
        raise ValueError(f"{prefix}{key} must be a {kind.__name__}, got {obj[key]!r}")
    return obj[key]


class SGLangClient:
    """Async calls to one inference server; one aiohttp session per client and event loop."""

    def __init__(self, base_url: str, timeout: float = 3600, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        """Sent as `Authorization: Bearer` with every call (None: the server is open)."""
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput:
        body = build_generate_request(input_ids, sampling_params, rid)
        return parse_generate_response(await self._call("POST", "/generate", body))

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], rids: list[str]
    ) -> list[GenerateOutput]:
        """Several prompts in one /generate (SGLang's batch form): one HTTP round trip for
        a group instead of one per sample; each output as `generate` would return it."""
        if not input_ids or any(not ids for ids in input_ids):
            raise ValueError("input_ids must not be empty")
        body = build_generate_request(input_ids[0], sampling_params[0], rids[0])
        body.update(
            input_ids=[[int(t) for t in ids] for ids in input_ids],
            sampling_params=[dict(p) for p in sampling_params],
            rid=list(rids),
        )
        result = await self._call("POST", "/generate", body)
        if not isinstance(result, list) or len(result) != len(input_ids):
            raise ValueError(
                f"the batched /generate response must be a list of {len(input_ids)} outputs"
            )
        return [parse_generate_response(r) for r in result]

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = False
    ) -> dict:
        """Load new weights; RuntimeError with the server's message when it refuses."""
        body = {
            "model_path": str(model_path),
            "weight_version": str(weight_version),
            "abort_all_requests": abort_all_requests,
            "flush_cache": True,
        }
        result = await self._call("POST", "/update_weights_from_disk", body, ok_statuses=(200, 400))
        if not isinstance(result, dict) or not result.get("success"):
            raise RuntimeError(
                f"{self.base_url} refused weights {model_path}: {error_message(result)}"
            )
        return result

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def flush_cache(self) -> str:
        return await self._call("POST", "/flush_cache", None)

    async def health(self) -> bool:
        try:
            session = await self._get_session()
            timeout = aiohttp.ClientTimeout(total=5)
            async with session.get(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

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

    async def wait_healthy(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Poll /health until 200; raise at once if proc (the server's process) exits."""
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"the inference server process exited with code {proc.returncode} "
                    f"before {self.base_url} became healthy; see its log"
                )
            if await self.health():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} was not healthy after {timeout:.0f} s")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._loop = None

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to the loop that made it; a new loop needs its own.
            # No connection limit: the staleness gate bounds how many requests are in flight.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=auth_header(self.api_key),
            )
            self._loop = loop
        return self._session

    async def _call(
        self, method: str, path: str, body: Any, ok_statuses: tuple[int, ...] = (200,)
    ) -> Any:
        """JSON (or text) of the answer; RuntimeError with the server's message otherwise,
        ServerDied when the connection is refused, reset or closed before the answer."""
        session = await self._get_session()
        try:
            async with session.request(method, self.base_url + path, json=body) as resp:
                raw = await resp.read()
                return self._content(method, path, resp, raw, ok_statuses)
        except aiohttp.ServerTimeoutError:
            raise  # slow, not dead: an asyncio.TimeoutError for the caller
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            raise ServerDied(self.base_url, f"{method} {path}", e) from e

    def _content(self, method: str, path: str, resp, raw: bytes, ok_statuses) -> Any:
        try:
            content: Any = json.loads(raw) if raw.strip() else None
        except ValueError:
            content = raw.decode(errors="replace")
        if resp.status not in ok_statuses:
            raise RuntimeError(
                f"{method} {self.base_url}{path} returned HTTP {resp.status}: "
                f"{error_message(content)}"
            )
        return content
