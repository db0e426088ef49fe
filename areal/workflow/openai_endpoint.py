"""An OpenAI-compatible endpoint that records the exact tokens of every call.

    agent --POST /v1/chat/completions (Bearer <session token>)--> OpenAIEndpoint
            messages --chat template--> input ids --session.engine.generate--> rollout worker
          <-- ChatCompletion --     records Call(input ids, output ids, log-probs,
              text, or tool_calls                       versions per token)
              (tool_parsers.py)

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
import json
import logging
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from areal.rollout.http_error import BadRequest  # the embedded server's too; OpenAI's body
from areal.workflow.samples import Call
from areal.workflow.tool_parsers import ParsedCalls, ToolParser, parse_qwen

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal.workflow.api import RolloutEngine

log = logging.getLogger("areal.workflow")


# ---- protocol: plain functions ------------------------------------------------------------


def request_params(body: Any, sampling: dict, default_max_tokens: int) -> dict[str, Any]:
    """{"max_new_tokens", "stop"} of a chat or completion request; BadRequest otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported: leave it out")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1: make one call per sample")
    if body.get("functions") or body.get("function_call"):
        raise BadRequest("functions / function_call are deprecated by OpenAI: send tools")
    for key in ("temperature", "top_p"):
        if key in body and body[key] is not None and body[key] != sampling[key]:
            raise BadRequest(
                f"{key}={body[key]!r} differs from the run's rollout.{key}={sampling[key]!r}; "
                "the trainer computes log-probs under the run's sampling: leave it out"
            )
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key):
            raise BadRequest(f"{key} must be 0: the trainer's log-probs assume no penalty")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings")
    return {"max_new_tokens": max_tokens, "stop": stop}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request says about tools."""

    tools: list[dict] | None
    """OpenAI function tools, for the chat template; None = the request has none."""
    names: frozenset[str]
    """Functions a parsed call may name; empty = do not parse (no tools, tool_choice none)."""
    parallel: bool
    """False: at most one call per answer (parallel_tool_calls)."""


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule


def tool_request(body: dict) -> ToolRequest:
    """tools, tool_choice and parallel_tool_calls checked; BadRequest saying what is wrong."""
    tools = body.get("tools") or None  # [] is sent by some frameworks for "no tools"
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"parallel_tool_calls must be true or false, got {parallel!r}")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools: send the functions it may call")
        return ToolRequest(tools=None, names=frozenset(), parallel=parallel is not False)
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {type: function, function: {name, ...}}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", '
                '"parameters"}}: only function tools are supported'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise BadRequest(f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}")
        if name in names:
            raise BadRequest(f"tools[{i}]: a second function named {name!r}")
        if not isinstance(fn.get("description", ""), str):
            raise BadRequest(f"tools[{i}].function.description must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if choice in (None, "auto", "required"):
        allowed = frozenset(names)
    elif choice == "none":
        allowed = frozenset()
    else:
        named = choice.get("function") if isinstance(choice, dict) else None
        name = named.get("name") if isinstance(named, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
            raise BadRequest(
                'tool_choice must be "auto", "none", "required" or '
                '{"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools")
        allowed = frozenset([name])
    return ToolRequest(tools=tools, names=allowed, parallel=parallel is not False)


def chat_messages(body: dict) -> list[dict]:
    """The messages, with OpenAI's content parts joined into the string templates expect,
    and assistant tool calls' arguments as objects (templates write them with tojson, as
    the model wrote them; SGLang and vLLM do the same)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise BadRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        if content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or text parts")
        message = {**m, "content": content or ""}
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise BadRequest(f"messages[{i}]: only assistant messages carry tool_calls")
            message["tool_calls"] = [
                _message_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(m["tool_calls"])
            ]
            call_ids.update(c["id"] for c in message["tool_calls"])
        elif "tool_calls" in m:
            del message["tool_calls"]  # null or []: a plain answer
        if m["role"] == "tool" and m.get("tool_call_id") not in call_ids:
            raise BadRequest(
                f"messages[{i}] (role tool) must answer an earlier assistant tool call: its "
                f"tool_call_id {m.get('tool_call_id')!r} is none of {sorted(call_ids)}"
            )
        out.append(message)
    return out


def parse_tool_calls(text: str, tools: ToolRequest, parser: ToolParser) -> ParsedCalls | None:
    """The answer's tool calls under the request's tool_choice and parallel_tool_calls, or
    None: the text is the answer."""
    if not tools.names:
        return None
    calls = parser(text, tools.names)
    if calls is not None and not tools.parallel:  # OpenAI's contract: at most one call
        calls = ParsedCalls(content=calls.content, tool_calls=calls.tool_calls[:1])
    return calls


def _message_tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f'{where} must be {{"id", "type": "function", "function": {{"name", '
                         '"arguments"}}')  # fmt: skip
    if not isinstance(call.get("id"), str):
        raise BadRequest(f"{where}.id must be a string (the id the tool result answers)")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise BadRequest(f"{where}.function.arguments is not JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object")
    return {**call, "type": "function", "function": {**fn, "arguments": arguments}}


def cut_at_stop(text: str, stop: list[str]) -> str:
    """OpenAI leaves a matched stop string, and what follows, out of the text."""
    cut = min((text.index(s) for s in stop if s in text), default=len(text))
    return text[:cut]


def chat_completion(
    call_id: str,
    model: str,
    text: str,
    finish: str,
    n_in: int,
    n_out: int,
    calls: ParsedCalls | None = None,
) -> dict:
    """One choice: the text, or (calls given) the calls and the text before them."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls is not None:
        message = {"role": "assistant", "content": calls.content, "tool_calls": calls.tool_calls}
        finish = "tool_calls"
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": _usage(n_in, n_out),
    }


def text_completion(
    call_id: str, model: str, text: str, finish: str, n_in: int, n_out: int
) -> dict:
    return {
        "id": call_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": _usage(n_in, n_out),
    }


def _usage(n_in: int, n_out: int) -> dict:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


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


def chat_input_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Any, tools: list[dict] | None
) -> list[int]:
    """The input ids of a chat request (messages in OpenAI's wire shapes, tools as sent),
    ending where the assistant speaks; BadRequest when the template cannot render it. The
    tiny model's warm-up renders its conversations here too (models/tiny.py), so that it
    trains on exactly the tokens an agent's calls become."""
    if tools and "tools" not in str(tokenizer.chat_template or ""):
        raise BadRequest(
            "the model's chat template does not render tools, so the model would "
            "never see them: use a model whose template has tools (Qwen2.5, Qwen3, "
            "the tiny model) or describe the tools in the prompt"
        )
    try:
        ids = tokenizer.apply_chat_template(
            chat_messages({"messages": messages}),
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except BadRequest:
        raise
    except Exception as e:  # the template refused the conversation
        raise BadRequest(f"the chat template failed on these messages: {e}") from e
    return [int(t) for t in ids]
