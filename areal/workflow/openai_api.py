"""OpenAI's chat and completions API as plain functions, tested without a server: request
checks and parameters, messages and tools as the chat template takes them, the model's
text turned into a ChatCompletion (tool calls parsed), and a conversation's input ids.

    request body --request_params / tool_request / chat_messages--> what to generate
    input ids    <--chat_input_ids(tokenizer, messages, tools)-- (the tiny model's warm-up
                                                                   renders through it too)
    output text  --parse_tool_calls / chat_completion / text_completion--> response body

The HTTP layer that serves them is openai_endpoint.py; errors are BadRequest (status, type).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.rollout.http_error import BadRequest  # the embedded server's too; OpenAI's body
from areal.workflow.tool_parsers import ParsedCalls, ToolParser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
