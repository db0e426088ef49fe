"""The add-tool agents (examples/agents_sdk_add.py, langchain_add.py) through the real
endpoint, against an engine that writes scripted outputs: each framework's calls are the
tiny model's warm-up sequences token for token (same template, tools schema and messages),
and each episode scores as examples/add_tool.py says. The framework tests skip themselves
where the framework is not installed (pip install -e ".[agents]")."""

from __future__ import annotations

import asyncio
import importlib
import random

import pytest

from areal.config import load_config
from areal.models.tiny import _warmup_sequences, build_tokenizer, episode_texts
from areal.trajectory import Trajectory
from areal.workflow.agent import AgentWorkflow
from areal.workflow.api import RolloutEngine
from areal.workflow.openai_api import chat_input_ids
from examples import add_tool

SPEC = "examples.add_tool:TASK"
FRAMEWORKS = {  # add_tool.TOOLS key -> (the framework's import name, the example)
    "agents_sdk": ("agents", "examples.agents_sdk_add"),
    "langchain": ("langchain_openai", "examples.langchain_add"),
}
TOOL_ERROR = "An error occurred while running the tool. Please try again."


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer of configs/agent_tools.yaml's tiny model (seed 1, operands up to 5)."""
    return build_tokenizer(1, episode_texts(SPEC, {"max_operand": 5}, 1))


def load_agent(framework: str):
    module, example = FRAMEWORKS[framework]
    pytest.importorskip("openai")
    pytest.importorskip(module)
    return importlib.import_module(example).run


def tool_episode(framework: str, a: int = 3, b: int = 4) -> list:
    """The warm-up's episode of a+b that calls add with this framework's schema."""
    tool = add_tool.TOOLS[framework]
    return add_tool.warmup_episode(f"{a}+{b}=", str(a + b), tool, random.Random(0), 1.0)


def play(run, tokenizer, outputs: list[str], max_turns: int = 3, prompt: str = "3+4="):
    """One episode of `run` whose model writes `outputs`, call by call: (its samples, each
    call's input ids)."""
    inputs: list[list[int]] = []

    async def scripted(input_ids: list[int], n: int, params: dict) -> list[Trajectory]:
        out = tokenizer.encode(outputs[len(inputs)], add_special_tokens=False)
        out.append(tokenizer.eos_token_id)
        inputs.append(list(input_ids))
        return [
            Trajectory(
                group_id=0,
                prompt_ids=list(input_ids),
                output_ids=out,
                logprobs=[-0.1] * len(out),
                versions=[0] * len(out),
                finish_reason="stop",
            )
        ]

    overrides = ["rollout.sample_mode=concat", f"rollout.max_turns={max_turns}"]
    workflow = AgentWorkflow(run, load_config(None, overrides).rollout)
    engine = RolloutEngine(
        tokenizer=tokenizer,
        group_size=1,
        sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 80},
        group_id=0,
        start_version=0,
        generate_fn=scripted,
    )
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))

    async def body():
        try:
            return await workflow.arun_episode(engine, {"prompt": prompt, "answer": str(a + b)})
        finally:
            await workflow.aclose()

    return asyncio.run(body()), inputs


def test_a_tool_episode_is_one_warmup_sequence(tokenizer):
    """The calls of a tool episode make one sequence; the loss is on the two answers only."""
    episode = tool_episode("langchain")
    ((ids, mask),) = _warmup_sequences(tokenizer, episode)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    eos = tokenizer.eos_token_id
    assert trained == (
        tokenizer.encode(add_tool.tool_call_text(3, 4), add_special_tokens=False)
        + [eos]
        + tokenizer.encode("7", add_special_tokens=False)
        + [eos]
    )
    assert ids[: mask.index(1)] == chat_input_ids(tokenizer, episode[0].messages, episode[0].tools)


def test_the_tool_tokenizer_spells_calls_and_prompts_short(tokenizer):
    """The tool-call tags are tokens of their own, and the BPE knows the prompt's words; the
    arith task (prompt/answer pairs) keeps the tokenizer every other tiny model has."""
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    assert len(tokenizer.encode(add_tool.tool_call_text(3, 4), add_special_tokens=False)) < 30
    for episode in (tool_episode("agents_sdk"), tool_episode("langchain")):
        call = episode[0]
        assert len(chat_input_ids(tokenizer, call.messages, call.tools)) < 250
    assert episode_texts("arith", None, 1) == []
    plain = build_tokenizer(1)
    assert "<tool_call>" not in plain.get_vocab()


def test_rewards():
    assert add_tool.reward("7", "7", used_tool=True) == add_tool.RIGHT_WITH_TOOL
    assert add_tool.reward(" 7\n", "7", used_tool=False) == add_tool.RIGHT_WITHOUT_TOOL
    assert add_tool.reward("8", "7", used_tool=True) == add_tool.WRONG
    assert add_tool.reward("3+4=7", "7", used_tool=True) == add_tool.WRONG  # not the number alone
    assert add_tool.reward(None, "7", used_tool=False) == add_tool.WRONG
    assert add_tool.RIGHT_WITH_TOOL > add_tool.RIGHT_WITHOUT_TOOL > 0 > add_tool.WRONG


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_frameworks_calls_are_the_warmups_sequences(tokenizer, framework):
    """The model calls add, the framework runs it, the model answers: each call's input is
    the warm-up's (the framework's own tools schema and messages, rendered by the endpoint),
    and the episode's concat sample is the warm-up's sequence, token for token."""
    run = load_agent(framework)
    episode = tool_episode(framework)
    (sample,), inputs = play(run, tokenizer, [call.response for call in episode])
    assert inputs == [chat_input_ids(tokenizer, c.messages, c.tools) for c in episode]
    ((ids, mask),) = _warmup_sequences(tokenizer, episode)
    assert sample.prompt_ids + sample.output_ids == ids
    assert [0] * len(sample.prompt_ids) + sample.loss_mask == mask
    assert sample.reward == add_tool.RIGHT_WITH_TOOL


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_direct_answers_score_without_the_tool(tokenizer, framework):
    run = load_agent(framework)
    (right,), inputs = play(run, tokenizer, ["7"])
    assert len(inputs) == 1 and right.reward == add_tool.RIGHT_WITHOUT_TOOL
    (wrong,), _ = play(run, tokenizer, ["8"])
    assert wrong.reward == add_tool.WRONG
    # A call the parser refuses (unclosed) is text, and not an answer.
    (broken,), _ = play(run, tokenizer, ['<tool_call>\n{"name": "add", "arguments": {"a": 3'])
    assert broken.reward == add_tool.WRONG


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_bad_arguments_and_endless_calls_end_the_episode_not_the_run(tokenizer, framework):
    run = load_agent(framework)
    # add without b: the model hears the tool failed, and its answer scores as untooled.
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    (sample,), inputs = play(run, tokenizer, [bad, "7"])
    assert TOOL_ERROR in tokenizer.decode(inputs[1])
    assert sample.reward == add_tool.RIGHT_WITHOUT_TOOL
    # Still calling add at the last call the agent allows: no answer, no overrun.
    call = add_tool.tool_call_text(3, 4)
    samples, inputs = play(run, tokenizer, [call] * 3, max_turns=3)
    assert len(inputs) == 3 and [s.reward for s in samples] == [add_tool.WRONG]


def test_varied_requests_keep_the_held_out_prompts_unseen_and_their_calls_append(tokenizer):
    """The warm-up's varied requests (tool_requests.py): none is an instruction or docstring
    of tests/documented_agents (which measure generalisation), every tool episode calls the
    schema's function with the schema's argument names and is one concat sequence."""
    from examples import tool_requests
    from tests.documented_agents import held_out

    rng = random.Random(0)
    seen_systems, seen_docs, kinds = set(), set(), set()
    for _ in range(3000):
        system, tool = tool_requests.request(rng)
        seen_systems.add(system)
        seen_docs.add(tool["function"]["description"])
        kinds.add((system is None, len(system or "") > 150))
    held = held_out()
    assert not (seen_systems | seen_docs) & held
    assert kinds == {(True, False), (False, False), (False, True)}  # none, short, long
    for _ in range(20):
        system, tool = tool_requests.request(rng)
        episode = add_tool.warmup_episode("3+4=", "7", tool, rng, 1.0, system)
        fn = tool["function"]
        first, second = fn["parameters"]["properties"]
        call = episode[0].response
        assert f'"name": "{fn["name"]}"' in call and f'"{first}": 3, "{second}": 4' in call
        assert len(_warmup_sequences(tokenizer, episode)) == 1


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_varied_tools_are_the_schemas_the_frameworks_send(framework):
    """tool_requests.tool writes a function's schema as the framework does."""
    from examples import tool_requests

    load_agent(framework)  # skips where the framework is not installed

    def add(x: int, y: int) -> int:
        """Sum two numbers."""
        return x + y

    if framework == "agents_sdk":
        from agents import function_tool
        from agents.models.chatcmpl_converter import Converter

        sent = Converter.tool_to_openai(function_tool(add))
    else:
        from langchain_core.tools import tool
        from langchain_core.utils.function_calling import convert_to_openai_tool

        sent = convert_to_openai_tool(tool(add))
    rng = random.Random(0)  # no argument docs drawn
    assert tool_requests.tool(rng, framework, "add", ("x", "y"), "Sum two numbers.") == sent
