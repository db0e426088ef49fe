r"""Tool-call parsers: the model's text -> OpenAI `tool_calls`, per model family's format.

    engine output ids --decode--> text --parser(text, callable names)--> ParsedCalls | None
        ParsedCalls -> message {"content": text before the first call or null,
                                "tool_calls": [{"id": "call_..", "type": "function",
                                                "function": {"name", "arguments": JSON str}}]},
                       finish_reason "tool_calls"
        None        -> message {"content": text}, finish_reason as the engine gave it

A parser is a plain function `(text, names) -> ParsedCalls | None`; `names` are the functions
the request lets the model call (all of `tools`, or the one `tool_choice` names). Parsing only
shapes the response the agent reads: the recorded tokens (the training sample) are the
engine's, whatever the parse. `rollout.tool_parser` picks one by name from TOOL_PARSERS, or
names the user's own as "package.module:function".

`qwen` (alias `hermes`): Qwen2 / Qwen2.5 / Qwen3 and Hermes-2-Pro emit

    optional text<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>\n<tool_call>...

How it compares with the serving engines' parsers for the same format: SGLang 0.5's
`Qwen25Detector.detect_and_parse` (+ `serving_chat`), vLLM's `Hermes2ProToolParser
.extract_tool_calls`. "text" = the whole output returned as content, no calls.

| the model's output                | SGLang qwen25         | vLLM hermes        | here           |
|-----------------------------------|-----------------------|--------------------|----------------|
| no `<tool_call>`                  | text                  | text               | text           |
| valid calls after some text       | calls; content = the  | calls; content =   | calls; content |
|                                   | text before, stripped | the text before,   | = the text     |
|                                   |                       | as is, or None     | before, strip- |
|                                   |                       |                    | ped, or null   |
| text between or after calls       | dropped               | dropped            | dropped        |
| one block's JSON malformed        | that call skipped     | text               | text           |
| a function not in `tools`         | that call dropped     | call returned      | text           |
| last block unclosed (max_tokens)  | that block ignored    | parsed to the end  | text           |
| `<tool_call>{` (no newline)       | text (needs `\n`)     | parsed             | parsed         |
| `"parameters"` for `"arguments"`  | accepted              | text               | accepted       |
| no `"arguments"`                  | `{}`                  | text               | `{}`           |
| finish_reason with calls          | tool_calls if stop    | tool_calls         | tool_calls     |

All or nothing, as vLLM: the agent gets either calls it can run or the model's whole text,
never a silently shortened list; a call the agent cannot dispatch (unknown name, truncated
JSON) reads as what it is, text. Calls keep the model's order; `arguments` is
`json.dumps(arguments, ensure_ascii=False)`, both engines' encoding, so that the chat
template renders the call back exactly as the model wrote it (samples.py's concat mode).
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCalls:
    """An output that is a tool call (or several)."""

    content: str | None
    """The text before the first call; None when there is none."""
    tool_calls: list[dict]
    """OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}."""


ToolParser = Callable[[str, Collection[str]], "ParsedCalls | None"]
"""`(text, names the model may call) -> ParsedCalls | None (the output is text)`."""


def tool_call(name: str, arguments: dict) -> dict:
    """One OpenAI tool call with a fresh id."""
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_qwen(text: str, names: Collection[str]) -> ParsedCalls | None:
    """Qwen2/2.5/3 (Hermes) `<tool_call>{json}</tool_call>` blocks; None = the text stands."""
    first = text.find(_QWEN_OPEN)
    if first < 0:
        return None
    if text.count(_QWEN_OPEN) != text.count(_QWEN_CLOSE):
        return None  # an unclosed block: cut by max_tokens, or not a call at all
    calls = []
    for block in _QWEN_BLOCK.findall(text, first):
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or name not in names:  # a sampled name may be any JSON
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(tool_call(name, arguments))
    content = text[:first].strip()
    return ParsedCalls(content=content or None, tool_calls=calls)


TOOL_PARSERS: dict[str, ToolParser] = {"qwen": parse_qwen, "hermes": parse_qwen}
"""Built-in parsers by rollout.tool_parser name."""


def load_tool_parser(spec: str) -> ToolParser:
    """The parser rollout.tool_parser names: a key of TOOL_PARSERS or "package.module:function";
    ValueError saying what to fix."""
    if spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(
            f"rollout.tool_parser={spec!r} is not a built-in parser ({', '.join(TOOL_PARSERS)}); "
            'name one, or your own as "package.module:function"'
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.tool_parser={spec!r}: cannot load it ({e})") from e
    if not callable(obj):
        raise ValueError(f"rollout.tool_parser={spec!r} is not a function (text, names)")
    return obj
