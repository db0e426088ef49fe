"""Tool calls: the qwen parser on recorded model outputs, the request's tool fields, and the
tiny chat template's rendering of tools, calls and results (round trips, token for token)."""

from __future__ import annotations

import json

import pytest

from areal.config import load_config
from areal.config_loader import ConfigError
from areal.models.tiny import build_tokenizer
from areal.workflow.openai_api import (
    BadRequest,
    chat_completion,
    chat_messages,
    parse_tool_calls,
    tool_request,
)
from areal.workflow.tool_parsers import TOOL_PARSERS, load_tool_parser, parse_qwen

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}

# Outputs as Qwen2.5-Instruct writes them (special tokens skipped by the decode).
ONE_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
TWO_CALLS = (
    "I will add both pairs.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": "x\u00e9"}}\n</tool_call>'
)


def _fn(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_one_call_and_several_calls_with_text_before():
    one = parse_qwen(ONE_CALL, {"add"})
    assert one is not None and one.content is None
    assert [_fn(c) for c in one.tool_calls] == [("add", {"a": 3, "b": 4})]
    assert one.tool_calls[0]["function"]["arguments"] == '{"a": 3, "b": 4}'
    two = parse_qwen(TWO_CALLS, {"add", "mul"})
    assert two is not None and two.content == "I will add both pairs."
    assert [_fn(c) for c in two.tool_calls] == [
        ("add", {"a": 3, "b": 4}),
        ("mul", {"a": 2, "b": "xé"}),
    ]
    assert "\u00e9" in two.tool_calls[1]["function"]["arguments"]  # ensure_ascii=False
    assert len({c["id"] for c in two.tool_calls}) == 2
    # No newline inside the tags, text after the call (dropped, as both engines do).
    tight = parse_qwen('ok <tool_call>{"name": "add", "arguments": {}}</tool_call> done', {"add"})
    assert tight is not None and tight.content == "ok" and _fn(tight.tool_calls[0]) == ("add", {})


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 7.",  # no call at all
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "sub", "arguments": {"a": 3}}\n</tool_call>',  # unknown function
        ONE_CALL + '\n<tool_call>\n{"name": "add", "arg',  # cut by max_tokens
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n</tool_call>',  # not an object
        '<tool_call>\n["add", {"a": 3}]\n</tool_call>',  # not a call object
        TWO_CALLS.replace('"mul"', '"mull"'),  # one of two calls unknown: all text
        # A name that is not a string (a sampled one, seen in CI: once a 500, TypeError)
        '<tool_call>\n{"name": {"add": 1}, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": ["add"], "arguments": {}}\n</tool_call>',
    ],
)
def test_what_is_not_a_valid_call_stays_text(text):
    assert parse_qwen(text, {"add", "mul"}) is None


def test_parameters_for_arguments_and_no_arguments():
    calls = parse_qwen(
        '<tool_call>\n{"name": "add", "parameters": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul"}\n</tool_call>',
        {"add", "mul"},
    )
    assert calls is not None
    assert [_fn(c) for c in calls.tool_calls] == [("add", {"a": 1}), ("mul", {})]


def test_tool_choice_none_required_named_and_parallel():
    body = {"tools": [ADD, MUL]}
    assert tool_request(body).names == {"add", "mul"}
    assert tool_request({**body, "tool_choice": "auto"}).names == {"add", "mul"}
    assert tool_request({**body, "tool_choice": "required"}).names == {"add", "mul"}
    assert tool_request({**body, "tool_choice": "none"}).names == frozenset()
    named = {"type": "function", "function": {"name": "mul"}}
    assert tool_request({**body, "tool_choice": named}).names == {"mul"}
    assert tool_request({}).tools is None and tool_request({"tools": []}).tools is None

    def parsed(**fields):
        return parse_tool_calls(TWO_CALLS, tool_request({**body, **fields}), parse_qwen)

    assert len(parsed().tool_calls) == 2
    assert parsed(tool_choice="none") is None  # the text, unparsed
    assert parsed(tool_choice=named) is None  # add is not the named function
    assert parsed(tool_choice="required") is not None
    assert [c["function"]["name"] for c in parsed(parallel_tool_calls=False).tool_calls] == ["add"]
    # The response: tool_calls and the text before them, finish_reason tool_calls.
    reply = chat_completion("chatcmpl-1", "tiny", TWO_CALLS, "stop", 5, 9, parsed())
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will add both pairs."
    assert len(choice["message"]["tool_calls"]) == 2
    plain = chat_completion("chatcmpl-2", "tiny", "7", "length", 5, 1)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "7"}
    assert plain["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "only function tools"),
        ({"tools": {"add": ADD}}, "must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must match"),
        ({"tools": [ADD, ADD]}, "second function"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "schema"),
        ({"tools": [ADD], "tool_choice": "always"}, "tool_choice must be"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "not one",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [ADD], "parallel_tool_calls": "yes"}, "true or false"),
    ],
)
def test_malformed_tool_fields_are_clear_400s(body, needle):
    with pytest.raises(BadRequest, match=needle) as e:
        tool_request(body)
    assert e.value.status == 400


def test_conversation_tool_calls_and_results_are_checked():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 3}'},
    }
    messages = [
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        {"role": "assistant", "content": "7", "tool_calls": None},
    ]
    out = chat_messages({"messages": messages})
    # Arguments as an object (the template writes it with tojson), the message otherwise as sent.
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 3}
    assert out[1]["content"] == "" and out[2]["tool_call_id"] == "call_1"
    assert "tool_calls" not in out[3]
    bad_args = {**call, "function": {"name": "add", "arguments": "{a: 3"}}
    for broken, needle in [
        ([messages[0], {**messages[1], "tool_calls": [bad_args]}], "not JSON"),
        ([messages[0], {**messages[1], "tool_calls": [{"id": "c"}]}], "tool_calls\\[0\\] must be"),
        ([{**messages[0], "tool_calls": [call]}], "only assistant"),
        ([messages[0], {"role": "tool", "tool_call_id": "call_1", "content": "7"}], "earlier"),
        ([*messages[:2], {"role": "tool", "tool_call_id": "call_9", "content": "7"}], "call_9"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            chat_messages({"messages": broken})


def test_parsers_are_chosen_by_name_or_import_path():
    assert load_tool_parser("qwen") is parse_qwen and TOOL_PARSERS["hermes"] is parse_qwen
    assert load_tool_parser("areal.workflow.tool_parsers:parse_qwen") is parse_qwen
    with pytest.raises(ValueError, match="not a built-in parser"):
        load_tool_parser("llama3")
    with pytest.raises(ValueError, match="cannot load"):
        load_tool_parser("areal.workflow.tool_parsers:nope")
    assert load_config(None, []).rollout.tool_parser == "qwen"
    with pytest.raises(ConfigError, match="tool_parser"):
        load_config(None, ["rollout.tool_parser=not a parser"])


# ---- rendering with the tiny model's chat template ----------------------------------------

# The tiny template before it rendered tools: conversations without tools must render the same.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _render(tok, messages, tools=None, template=None, **kw):
    return tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, **kw
    )


def test_conversations_without_tools_render_as_before(tokenizer):
    conversations = [
        [{"role": "user", "content": "3+4="}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "3+4="},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "wrong, try again"},
        ],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": "x\ny"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            old = _render(tokenizer, messages, template=CHATML, add_generation_prompt=gen)
            assert _render(tokenizer, messages, add_generation_prompt=gen) == old
            assert _render(tokenizer, messages, tools=[], add_generation_prompt=gen) == old


def test_tools_calls_and_results_render_the_qwen25_way(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "3+4="},
    ]
    prompt = _render(tokenizer, messages, tools=[ADD, MUL], add_generation_prompt=True)
    system, rest = prompt.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    schemas = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in schemas.split("\n")] == [ADD, MUL]
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in system
    )
    assert rest == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


def test_round_trip_calls_render_back_as_the_model_wrote_them(tokenizer):
    """The model's output, parsed into tool_calls, sent back by the agent with the tools'
    results, renders as prompt + that output: token for token, what concat mode needs."""
    tools = [ADD, MUL]
    messages = [{"role": "user", "content": "3+4= and 2*x="}]
    prompt_ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=False
    )
    output_ids = tokenizer.encode(TWO_CALLS, add_special_tokens=False) + [tokenizer.eos_token_id]
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    calls = parse_qwen(text, {"add", "mul"})
    assert calls is not None
    # What an OpenAI client sends back: the assistant message, then one result per call.
    messages += [
        {"role": "assistant", "content": calls.content, "tool_calls": calls.tool_calls},
        *[
            {"role": "tool", "tool_call_id": c["id"], "content": str(i)}
            for i, c in enumerate(calls.tool_calls)
        ],
    ]
    next_ids = tokenizer.apply_chat_template(
        chat_messages({"messages": messages}),
        tools=tools,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert next_ids[: len(prompt_ids) + len(output_ids)] == prompt_ids + output_ids
    env = tokenizer.decode(next_ids[len(prompt_ids) + len(output_ids) :])
    assert env == (
        "\n<|im_start|>user\n<tool_response>\n0\n</tool_response>\n"
        "<tool_response>\n1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
