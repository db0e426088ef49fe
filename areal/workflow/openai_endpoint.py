"""An OpenAI-compatible endpoint that records the exact tokens of every call.

    agent --POST /v1/chat/completions (Bearer <session token>)--> OpenAIEndpoint
            messages --chat template--> input ids --session.engine.generate--> rollout worker
          <-- ChatCompletion (text) --     records Call(input ids, output ids, log-probs,
                                                        versions per token)

One session per agent episode; its token, sent as the API key, picks the session, so any
OpenAI client works unchanged (`AsyncOpenAI(base_url=endpoint.base_url, api_key=token)`).
Generation goes through the engine, i.e. the rollout workers' interruptible path: a call cut
by a weight update is resumed, its tokens keeping the versions that produced them. The
agent sees only text; training uses the recorded ids (samples.py).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models. Sampling is the
run's (the trainer's log-probs assume rollout.temperature, top_p, top_k): a request may
set only the length, and may repeat the run's values; one call returns one choice, not
streamed. A session's (max_turns + 1)-th call is refused, and marks the episode overrun.
A call that ends after its episode did (rejected, timed out) is answered 410 and dropped.

| waits for                      | unblocked by                                   |
|--------------------------------|------------------------------------------------|
| a call's generation            | its rollout worker (resumed across updates)    |
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from areal.rollout.http_error import BadRequest  # the embedded server's too; OpenAI's body
from areal.workflow.samples import Call

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
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tools are not supported: describe them in the prompt and parse text")
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


def chat_messages(body: dict) -> list[dict]:
    """The messages, with OpenAI's content parts joined into the string templates expect."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out = []
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
        out.append({**m, "content": content or ""})
    return out


def cut_at_stop(text: str, stop: list[str]) -> str:
    """OpenAI leaves a matched stop string, and what follows, out of the text."""
    cut = min((text.index(s) for s in stop if s in text), default=len(text))
    return text[:cut]


def chat_completion(
    call_id: str, model: str, text: str, finish: str, n_in: int, n_out: int
) -> dict:
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
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


class OpenAIEndpoint:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str,
        default_max_tokens: int,
        sampling: dict,
    ):
        self.tokenizer = tokenizer
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
        """No call of the session is recorded after this (late ones are answered 410)."""
        session.closed = True
        self.sessions.pop(session.token, None)

    # ---- handlers -------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "areal"}]}
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
            input_ids = self._input_ids(body, chat)
            session.n_started += 1
            if session.n_started > session.max_turns:
                session.overrun = (
                    f"the episode made more than rollout.max_turns={session.max_turns} calls"
                )
                raise BadRequest(session.overrun, code="max_turns_exceeded")
            (traj,) = await session.engine.generate(input_ids, 1, params["max_new_tokens"])
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
        shape = chat_completion if chat else text_completion
        return web.json_response(
            shape(call.id, self.model, text, finish, len(input_ids), len(traj.output_ids))
        )

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

    def _input_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            try:
                ids = self.tokenizer.apply_chat_template(
                    chat_messages(body),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            except BadRequest:
                raise
            except Exception as e:  # the template refused the conversation
                raise BadRequest(f"the chat template failed on these messages: {e}") from e
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                ids = prompt  # token ids, used as they are
            elif isinstance(prompt, str) and prompt:
                ids = self.tokenizer(prompt)["input_ids"]
            else:
                raise BadRequest("prompt must be a non-empty string or list of token ids")
        return [int(t) for t in ids]
