"""An OpenAI-compatible endpoint that records the exact tokens of every call.

    agent --POST /v1/chat/completions (Bearer <session token>)--> OpenAIEndpoint
            messages --chat template--> input ids --session.engine.generate--> rollout worker
          <-- ChatCompletion --     records Call(input ids, output ids, log-probs,
              text, or tool_calls                       versions per token)
              (tool_parsers.py)

This module is the HTTP layer and the sessions; the API's request and response shapes are
plain functions in openai_api.py.

One session per agent episode; its token, sent as the API key, picks the session, so any
OpenAI client works unchanged (`AsyncOpenAI(base_url=endpoint.base_url, api_key=token)`).
Generation goes through the engine, i.e. the rollout workers' interruptible path: a call cut
by a weight update is resumed, its tokens keeping the versions that produced them. The
agent sees text and parsed tool calls; training uses the recorded ids (samples.py).

Tools: a chat request may carry OpenAI function `tools`, `tool_choice` and
`parallel_tool_calls`, and its conversation assistant `tool_calls` and `tool` results. The
model's own chat template renders them (`apply_chat_template(tools=...)`; a template that
ignores tools is refused, not silently dropped), and rollout.tool_parser turns the model's
text into `tool_calls` (tool_parsers.py). `tool_choice`: "none" returns text unparsed;
"required" and a named function are not forced by constrained decoding (a grammar would
change the sampling distribution the trainer's log-probs assume): the model sees the tools
as under "auto", only the named function counts as a call, and anything else returns as
text for the agent to handle. `parallel_tool_calls: false` keeps the first call only. A
function's `"strict": true` (the OpenAI Agents SDK's default) is likewise not enforced: the
tool is rendered as sent, and arguments that miss the schema reach the agent's framework,
which validates them (examples/add_tool.py).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models; POST
/v1/responses (the Responses API, the OpenAI Agents SDK's default) answers 404 saying to
use chat completions (OpenAIChatCompletionsModel). Sampling is the
run's (the trainer's log-probs assume rollout.temperature, top_p, top_k): a request may
set only the length, and may repeat the run's values; one call returns one choice, not
streamed. A session's (max_turns + 1)-th call is refused, and marks the episode overrun.
A call still generating when its episode ends (rejected, timed out) is cancelled, which
aborts its requests on the server (the pool abandons them), and is answered 410.

| waits for                      | unblocked by                                   |
|--------------------------------|------------------------------------------------|
| a call's generation            | its rollout worker (resumed across updates)    |
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from areal.rollout.http_error import BadRequest  # the embedded server's too; OpenAI's body
from areal.workflow.openai_api import (
    ToolRequest,
    chat_completion,
    chat_input_ids,
    cut_at_stop,
    parse_tool_calls,
    request_params,
    text_completion,
    tool_request,
)
from areal.workflow.samples import Call
from areal.workflow.tool_parsers import ToolParser, parse_qwen

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal.workflow.api import RolloutEngine

log = logging.getLogger("areal.workflow")


def _error(message: str, status: int, code: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": code, "param": None, "code": code}}, status=status
    )


# ---- sessions and the HTTP layer ----------------------------------------------------------


@dataclass(kw_only=True)
class Session:
    """One agent episode's calls, in the order they finished."""

    token: str
    engine: Any
    """A RolloutEngine (areal/workflow/api.py): its generate() is the interruptible path."""
    max_turns: int
    calls: list[Call] = field(default_factory=list)
    n_started: int = 0
    overrun: str = ""
    """Why the episode broke its limits ("" = it did not)."""
    closed: bool = False
    generating: set[asyncio.Task] = field(default_factory=set)
    """Its calls' generations in flight: cancelled when the session closes."""


class OpenAIEndpoint:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str,
        default_max_tokens: int,
        sampling: dict,
        tool_parser: ToolParser = parse_qwen,
    ):
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        """rollout.tool_parser: the model's text -> tool calls (tool_parsers.py)."""
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.sampling = sampling
        self.sessions: dict[str, Session] = {}
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1") -> str:
        """Listen on a free port of host; returns the base URL (ending in /v1)."""
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", self._responses)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        await web.SockSite(self._runner, sock).start()
        self.base_url = f"http://{host}:{sock.getsockname()[1]}/v1"
        log.info("OpenAI-compatible endpoint at %s", self.base_url)
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, engine: RolloutEngine, max_turns: int) -> Session:
        session = Session(token=secrets.token_hex(16), engine=engine, max_turns=max_turns)
        self.sessions[session.token] = session
        return session

    def close_session(self, session: Session) -> None:
        """No call of the session is recorded after this: the ones in flight are cancelled
        (their requests aborted on the server) and answered 410."""
        session.closed = True
        self.sessions.pop(session.token, None)
        for generation in session.generating:
            generation.cancel()

    # ---- handlers -------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "areal"}]}
        )

    async def _responses(self, request: web.Request) -> web.Response:
        return _error(
            "the Responses API (/v1/responses) is not served here: use chat completions "
            "(the OpenAI Agents SDK: OpenAIChatCompletionsModel(model=..., openai_client="
            "client); openai: client.chat.completions.create)",
            404,
            "not_found",
        )

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.Response:
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except ValueError as e:
                raise BadRequest(f"the body is not JSON: {e}") from e
            params = request_params(body, self.sampling, self.default_max_tokens)
            tools = tool_request(body) if chat else None
            input_ids = self._input_ids(body, tools)
            session.n_started += 1
            if session.n_started > session.max_turns:
                session.overrun = (
                    f"the episode made more than rollout.max_turns={session.max_turns} calls"
                )
                raise BadRequest(session.overrun, code="max_turns_exceeded")
            (traj,) = await self._generate(session, input_ids, params["max_new_tokens"])
        except BadRequest as e:
            return _error(str(e), e.status, e.code)
        except Exception as e:  # generation failed (e.g. the prompt is too long for the model)
            log.warning("a call failed: %s: %s", type(e).__name__, e)
            return _error(f"generation failed: {type(e).__name__}: {e}", 500, "server_error")
        if session.closed:
            return _error("the episode of this session has ended", 410, "session_closed")
        call = Call(id=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), traj=traj)
        session.calls.append(call)
        text = self.tokenizer.decode(traj.output_ids, skip_special_tokens=True)
        text = cut_at_stop(text, params["stop"])
        finish = "length" if traj.finish_reason == "length" else "stop"
        n_in, n_out = len(input_ids), len(traj.output_ids)
        if not chat:
            shaped = text_completion(call.id, self.model, text, finish, n_in, n_out)
            return web.json_response(shaped)
        # Only the response is shaped by the parse; the recorded call keeps the engine's tokens.
        calls = parse_tool_calls(text, tools, self.tool_parser)
        call.tool_calls = len(calls.tool_calls) if calls is not None else 0
        return web.json_response(
            chat_completion(call.id, self.model, text, finish, n_in, n_out, calls)
        )

    async def _generate(self, session: Session, input_ids: list[int], max_new: int) -> list:
        generation = asyncio.ensure_future(session.engine.generate(input_ids, 1, max_new))
        session.generating.add(generation)
        try:
            return await generation
        except asyncio.CancelledError as e:
            if not (session.closed and generation.cancelled()):
                raise  # this handler itself was cancelled
            raise BadRequest("the episode of this session has ended", 410, "session_closed") from e
        finally:
            session.generating.discard(generation)

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip()
        session = self.sessions.get(token)
        if session is None:
            raise BadRequest(
                "unknown session: use the client the episode was given (its api_key is the "
                "session's token)",
                401,
                "invalid_api_key",
            )
        return session

    def _input_ids(self, body: dict, tools: ToolRequest | None) -> list[int]:
        """The chat template's ids of the conversation (tools: a chat request's), or the
        completion's prompt."""
        if tools is not None:
            return chat_input_ids(self.tokenizer, body.get("messages"), tools.tools)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt  # token ids, used as they are
        elif isinstance(prompt, str) and prompt:
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            raise BadRequest("prompt must be a non-empty string or list of token ids")
        return [int(t) for t in ids]
