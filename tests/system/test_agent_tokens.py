"""Agents through the real `openai` client: every training sample is token-exact.

A real embedded server (subprocess), the real rollout worker behind a real RPC socket, the
real controller path (gate, workflow, buffer) and the OpenAI-compatible endpoint. An agent
holds a multi-turn conversation through `openai.AsyncOpenAI`; the samples the controller
buffers are checked against what the agent sent (the chat template applied by us, here),
against the text it got back, and against transformers' log-probs of each token under the
weights of the version it is tagged with, which a wrong token or a wrong version fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.comm.rpc import RpcClient, RpcServer
from areal.config import load_config
from areal.controller.controller import Controller
from areal.models.cache import tiny_model
from areal.models.tiny import build_tokenizer, make_tiny_model
from areal.rollout.client import SGLangClient
from areal.rollout.worker import RolloutWorker
from areal.trainer.ppo_batch import TokenTensors
from areal.trajectory import Trajectory
from areal.worker import make_controller as build_controller
from areal.workflow.agent import AgentWorkflow
from areal.workflow.api import RolloutEngine
from areal.workflow.openai_api import chat_messages
from tests.system.conftest import copy_weights, embedded_server, ref_logprobs
from tests.unit.test_tool_parsers import ADD as ADD_TOOL

pytest.importorskip("openai")

KEY = b"k" * 32
FEEDBACK = "wrong, try again"


@pytest.fixture(scope="module")
def random_versions(tmp_path_factory) -> list[Path]:
    """An untrained model (v0) and a visibly different policy (v1)."""
    root = tmp_path_factory.mktemp("weights")
    v0 = make_tiny_model(root / "v0", warmup_steps=0)

    def edit(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 3.0

    return [v0, copy_weights(v0, root / "v1", edit)]


@pytest.fixture(scope="module")
def warm_model() -> Path:
    """The tiny run's model (answers in digits, then ends its turn), shared with the runs."""
    return tiny_model(seed=1, options={"max_operand": 5})  # the session's cache (conftest.py)


def make_controller(agent, workers, tokenizer, *overrides: str) -> Controller:
    """Agents made inside a test (closures that record what they saw) run on the controller's
    loop; module-level ones in an agent process, as a run would."""
    in_loop = "<locals>" in agent.__qualname__
    cfg = load_config(
        None,
        [
            "rollout.group_size=1",
            "rollout.max_turns=4",
            f"rollout.agent_processes={0 if in_loop else 1}",
            *overrides,
        ],
    )
    rows = [{"prompt": "3+4=", "answer": "7", "task": "arith", "prompt_ids": [1]}]
    return build_controller(
        cfg, rows, tokenizer, workers, reward=None, workflow=AgentWorkflow(agent, cfg.rollout)
    )


async def run_group(c: Controller) -> list | None:
    """One admitted row through the controller's own path; its buffered group or None."""
    return await (await c.admit())


class Served:
    """A RolloutWorker behind a real RPC server, as the controller reaches it."""

    def __init__(self, url: str):
        self.worker = RolloutWorker(url)
        self.server = RpcServer(KEY, host="127.0.0.1")
        for name in RolloutWorker.RPC_METHODS:
            self.server.register(name, getattr(self.worker, name))
        self.task = asyncio.create_task(self.server.serve())
        self.client = RpcClient(self.server.address, KEY)

    async def close(self) -> None:
        self.client.close()
        self.server.close()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.worker.client.close()


def conversation_agent(max_tokens: list[int], sent: list[list[dict]], seen: list[str]):
    """Answers, hears "wrong, try again", answers again; rewards every call by its id."""

    async def run(data, client) -> dict[str, float]:
        messages = [{"role": "user", "content": data["prompt"]}]
        rewards = {}
        for turn, n in enumerate(max_tokens):
            sent.append([dict(m) for m in messages])
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=n
            )
            text = reply.choices[0].message.content
            seen.append((text, reply.usage.completion_tokens))
            rewards[reply.id] = float(turn)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": FEEDBACK},
            ]
        return rewards

    return run


async def generated(url: str) -> int:
    client = SGLangClient(url)
    try:
        return (await client.server_info())["total_generated_tokens"]
    finally:
        await client.close()


@pytest.fixture(scope="module")
def random_server(random_versions, tmp_path_factory):
    with embedded_server(random_versions[0], tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


def test_individual_samples_are_token_exact_across_a_weight_update(random_versions, random_server):
    tokenizer = AutoTokenizer.from_pretrained(random_versions[0])
    sent: list[list[dict]] = []
    seen: list[tuple[str, int]] = []
    # Call 2 is long: the update, sent 10 tokens into it, lands 20-35 tokens into it on a
    # quiet machine, and a loaded one (CI) must not let call 2 finish first.
    max_tokens = [4, 300, 4]

    async def body(url: str):
        served = Served(url)
        try:
            c = make_controller(
                conversation_agent(max_tokens, sent, seen),
                [served.client],
                tokenizer,
                "rollout.turn_discount=0.5",
            )
            # Every call runs to its max_tokens, so the update surely lands inside call 2.
            c.sampling["ignore_eos"] = True
            start = await generated(url)
            group_run = asyncio.create_task(run_group(c))
            deadline = asyncio.get_running_loop().time() + 60
            while await generated(url) < start + max_tokens[0] + 10:
                assert asyncio.get_running_loop().time() < deadline, "no progress"
                assert not group_run.done(), group_run
                await asyncio.sleep(0.01)
            reply = await served.client.call(
                "update_weights", version=1, path=str(random_versions[1])
            )
            assert reply["loaded"]
            group = await asyncio.wait_for(group_run, 60)
            return group, c
        finally:
            await served.close()

    group, c = asyncio.run(body(random_server))

    assert group is not None and len(group) == 3  # one sample per call
    models = [
        AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).eval() for v in random_versions
    ]
    for i, (t, messages, (text, _)) in enumerate(zip(group, sent, seen, strict=True)):
        # Exactly the tokens the engine received: the conversation the agent sent, templated.
        expected_prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert t.prompt_ids == list(expected_prompt)
        assert len(t.output_ids) == len(t.logprobs) == len(t.versions) == max_tokens[i]
        assert tokenizer.decode(t.output_ids, skip_special_tokens=True) == text
        # Each token's log-prob is what its own version's weights give it, token for token.
        by_version = torch.stack([ref_logprobs(m, t.prompt_ids, t.output_ids, 1.0) for m in models])
        tags = torch.tensor(t.versions)
        expected = by_version[tags, torch.arange(len(t.output_ids))]
        assert torch.allclose(torch.tensor(t.logprobs), expected, atol=1e-4, rtol=0)
        # The loss covers exactly the call's output tokens.
        mask = TokenTensors.of(t).mask
        assert mask.tolist() == [0.0] * (len(t.prompt_ids) - 1) + [1.0] * len(t.output_ids)
    # Call 1 under v0, call 2 cut by the update (both versions, in order), call 3 under v1.
    assert set(group[0].versions) == {0} and set(group[2].versions) == {1}
    assert group[1].versions == sorted(group[1].versions) and set(group[1].versions) == {0, 1}
    assert group[1].n_interrupts == 1
    # Per-call rewards 0, 1, 2 discounted once with gamma 0.5: 0 + .5 * (1 + .5 * 2) = 1.
    assert [t.reward for t in group] == [1.0, 2.0, 2.0]
    assert {t.group_id for t in group} == {0} and c.gate.n_accepted == 1
    stats = c.workflow.stats()
    assert stats["episode/calls_mean"] == 3 and stats["episode/return_mean"] == 3.0


NOT_APPEND_ONLY = (
    # Numbers every user turn by the conversation's length: earlier turns render differently
    # once the conversation grows (like templates that drop earlier reasoning).
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ messages|length }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["append_only", "not_append_only"])
def test_concat_one_sequence_or_fallback(warm_model, tmp_path, template):
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    if template == "not_append_only":
        tokenizer.chat_template = NOT_APPEND_ONLY
    sent: list[list[dict]] = []
    seen: list[tuple[str, int]] = []
    max_tokens = [3, 3, 3]

    async def body(url: str):
        served = Served(url)
        try:
            c = make_controller(
                conversation_agent(max_tokens, sent, seen),
                [served.client],
                tokenizer,
                "rollout.sample_mode=concat",
            )
            return await asyncio.wait_for(run_group(c), 60), c.workflow.stats()
        finally:
            await served.close()

    with embedded_server(warm_model, tmp_path / "server.log") as url:
        group, stats = asyncio.run(body(url))

    calls = [
        tokenizer.apply_chat_template(
            m, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for m in sent
    ]
    if template == "not_append_only":
        assert stats["rollout/concat_fallbacks"] == 1
        assert [t.prompt_ids for t in group] == calls  # individual samples, exact as ever
        assert all(not t.loss_mask for t in group)
        return
    assert stats["rollout/concat_fallbacks"] == 0
    (t,) = group
    seq = t.prompt_ids + t.output_ids
    assert len(t.loss_mask) == len(t.output_ids) == len(t.logprobs) == len(t.versions)
    mask = [0] * len(t.prompt_ids) + t.loss_mask
    # Each run of 1s is one call's output, as long as the server reported it; what precedes
    # it is exactly that call's input (the conversation the agent sent, templated), so every
    # 0 between runs is a template or feedback token, never the model's.
    spans = _runs(mask)
    assert len(spans) == len(calls) == 3
    for (a, b), c_ids, (text, n_out) in zip(spans, calls, seen, strict=True):
        assert seq[:a] == c_ids
        assert b - a == n_out
        assert tokenizer.decode(seq[a:b], skip_special_tokens=True) == text
    assert spans[-1][1] == len(seq)
    model = AutoModelForCausalLM.from_pretrained(warm_model, dtype=torch.float32).eval()
    ref = ref_logprobs(model, t.prompt_ids, t.output_ids, 1.0)
    model_tokens = torch.tensor(t.loss_mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(t.logprobs)[model_tokens], ref[model_tokens], atol=1e-4)
    # The trainer: loss only on the model's tokens; environment tokens out of the version check.
    tensors = TokenTensors.of(t)
    assert tensors.mask.tolist() == [float(m) for m in mask[1:]]
    assert (tensors.versions[tensors.mask == 0] == -1).all()


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


async def _one_call(client):
    return await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=2
    )


async def _raises(data, client):
    await _one_call(client)
    raise ValueError("a bug in the agent")


async def _garbage(data, client):
    await _one_call(client)
    return "seven"


async def _unknown_call(data, client):
    await _one_call(client)
    return {"chatcmpl-not-mine": 1.0}


async def _not_finite(data, client):
    await _one_call(client)
    return float("nan")


async def _no_call(data, client):
    return 1.0


async def _overruns(data, client):
    for _ in range(5):
        try:
            await _one_call(client)
        except Exception:  # the agent swallows the refusal: still an overrun episode
            pass
    return 1.0


async def _kills_its_process(data, client):
    await _one_call(client)
    os.kill(os.getpid(), signal.SIGKILL)  # a segfaulting tool, the OOM killer


async def _hangs(data, client):
    await _one_call(client)
    await asyncio.sleep(60)
    return 1.0


@pytest.mark.parametrize(
    ("agent", "needle", "counter"),
    [
        (_raises, "a bug in the agent", "rejected"),
        (_garbage, "return a float", "rejected"),
        (_unknown_call, "no call of its episode", "rejected"),
        (_not_finite, "finite", "rejected"),
        (_no_call, "made no call", "rejected"),
        (_overruns, "max_turns=2", "rejected"),
        (_kills_its_process, "agent process 0 died (exit status -9)", "rejected"),
        (_hangs, "episode_timeout_s", "timeout"),
    ],
)
def test_failed_episodes_free_the_gate_and_their_prompt_comes_back(
    random_versions, random_server, caplog, agent, needle, counter
):
    tokenizer = AutoTokenizer.from_pretrained(random_versions[0])

    async def body():
        served = Served(random_server)
        try:
            c = make_controller(
                agent,
                [served.client],
                tokenizer,
                "rollout.group_size=2",
                "rollout.max_turns=2",
                # 3 s for the agent that hangs; the others must fail by themselves.
                f"rollout.episode_timeout_s={3 if counter == 'timeout' else 60}",
            )
            capacity = c.gate.capacity()
            row = c.rows[0]
            groups = [await run_group(c) for _ in range(2)]
            return c, capacity, row, groups, c.workflow.stats()
        finally:
            await c.workflow.aclose()
            await served.close()

    c, capacity, row, groups, workflow_stats = asyncio.run(body())
    assert groups == [None, None]
    # Nothing kept, the place in the gate free again, the prompt waiting to be generated.
    assert (c.gate.n_running, c.gate.n_accepted, c.gate.capacity()) == (0, 0, capacity)
    assert len(c.buffer) == 0 and c.buffer.n_in_flight == 0
    # The row comes back as it was drawn: the dataset's row and its draw id.
    assert c.draws.retry == [{**row, "draw_id": 0}] and c.draws.out == {}
    stats = c.episodes.stats()
    assert stats[f"rollout/episodes_{counter}"] == 2
    assert needle in caplog.text
    if counter == "rejected":  # the traceback once, then one line
        assert caplog.text.count("episode rejected (its prompt") == 1
        assert "episode rejected again" in caplog.text
    if agent is _kills_its_process:  # the second group waited for it to be started again
        assert workflow_stats["episode/agent_restarts"] >= 1


# What the model writes in each call of the episode (Qwen's tool-call format): two calls at
# once, then one more, then the answer.
SCRIPT = [
    'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 2}}\n</tool_call>',
    "9",
]


def test_tool_calls_through_the_openai_client_keep_the_engines_tokens():
    """The real client and endpoint against an engine that writes SCRIPT (a tiny random model
    would not call tools): tool_calls come back parsed, the agent's results are rendered by
    the template, and the concat sample is the engine's tokens, tool results masked out."""
    tokenizer = build_tokenizer()
    produced: list[Trajectory] = []

    async def scripted(input_ids: list[int], n: int, params: dict) -> list[Trajectory]:
        k = len(produced)
        out = tokenizer.encode(SCRIPT[k], add_special_tokens=False) + [tokenizer.eos_token_id]
        half = len(out) // 2  # the second call straddles a weight update: versions 0 then 1
        t = Trajectory(
            group_id=0,
            prompt_ids=list(input_ids),
            output_ids=out,
            logprobs=[-0.01 * (k * 100 + i + 1) for i in range(len(out))],
            versions=[0] * len(out) if k == 0 else [0] * half + [1] * (len(out) - half),
            finish_reason="stop",
        )
        produced.append(t)
        return [t]

    replies: list = []
    sent: list[list[dict]] = []

    async def agent(data, client) -> float:
        messages = [{"role": "user", "content": data["prompt"]}]
        while True:
            sent.append([dict(m) for m in messages])
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, tools=[ADD_TOOL], max_tokens=64
            )
            replies.append(reply.choices[0])
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(message.content == "9")
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
                )

    overrides = ["rollout.sample_mode=concat", "rollout.max_turns=4", "rollout.agent_processes=0"]
    cfg = load_config(None, overrides).rollout
    workflow = AgentWorkflow(agent, cfg)
    engine = RolloutEngine(
        tokenizer=tokenizer,
        group_size=1,
        sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8},
        group_id=0,
        start_version=0,
        generate_fn=scripted,
    )

    async def body():
        try:
            return await workflow.arun_episode(engine, {"prompt": "3+4+1+1="})
        finally:
            await workflow.aclose()

    (t,) = asyncio.run(body())

    # The agent read parsed calls, then the answer.
    assert [c.finish_reason for c in replies] == ["tool_calls", "tool_calls", "stop"]
    assert replies[0].message.content == "Adding."
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in replies[0].message.tool_calls
    ] == [("add", {"a": 3, "b": 4}), ("add", {"a": 1, "b": 1})]
    assert replies[1].message.content is None and len(replies[1].message.tool_calls) == 1
    assert replies[2].message.content == "9" and t.reward == 1.0
    # Each call's input: exactly the conversation the agent sent, tools included, templated.
    for p, messages in zip(produced, sent, strict=True):
        expected = tokenizer.apply_chat_template(
            chat_messages({"messages": messages}),
            tools=[ADD_TOOL],
            add_generation_prompt=True,
            return_dict=False,
        )
        assert p.prompt_ids == expected
    # One sequence: the engine's outputs (mask 1, their log-probs and versions as produced)
    # with the template's and the tools' tokens between them (mask 0).
    assert t.prompt_ids == produced[0].prompt_ids
    spans = _runs([0] * len(t.prompt_ids) + t.loss_mask)
    seq = t.prompt_ids + t.output_ids
    assert len(spans) == 3
    n = len(t.prompt_ids)
    for (a, b), p in zip(spans, produced, strict=True):
        assert seq[:a] == p.prompt_ids and seq[a:b] == p.output_ids
        assert t.logprobs[a - n : b - n] == p.logprobs and t.versions[a - n : b - n] == p.versions
    gaps = zip(spans[:-1], spans[1:], strict=True)
    results = [tokenizer.decode(seq[b:a]) for (_, b), (a, _) in gaps]
    assert results == [
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ]
    assert workflow.stats()["rollout/concat_fallbacks"] == 0


BLOCK_S = 2.0


async def _blocks(data, client):
    """An agent written without care: a synchronous call, then a CPU-heavy tool."""
    await _one_call(client)
    time.sleep(BLOCK_S)  # e.g. requests.get, or LangChain's invoke
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # e.g. a solver in pure Python
        pass
    return 1.0


@pytest.mark.parametrize("processes", [1, 0])
def test_a_blocking_agent_stalls_nothing_of_the_controller_in_an_agent_process(
    random_versions, random_server, processes
):
    """A group of two blocking episodes runs while the controller's loop serves a
    single-turn workload (generations through the pool, as other groups would). In an agent
    process the loop never lags more than lag_bound_s and every single-turn generation ends
    while the agents still block; on the controller's loop (processes=0) the loop stops for
    the whole BLOCK_S, which is what the agent processes are for."""
    lag_bound_s = 0.5  # an idle loop's tick lags ~10 ms here, ~100 ms on a loaded 2-core CI
    tokenizer = AutoTokenizer.from_pretrained(random_versions[0])
    prompt = tokenizer("1+1=")["input_ids"]

    async def body() -> tuple[float, list[float], float]:
        served = Served(random_server)
        c = make_controller(
            _blocks, [served.client], tokenizer, "rollout.group_size=2",
            f"rollout.agent_processes={processes}", "rollout.episode_timeout_s=60",
        )  # fmt: skip
        lag, done_at = 0.0, []

        async def ticker() -> None:
            nonlocal lag
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - t - 0.01)

        async def single_turn() -> None:
            for i in range(5):
                await c.pool.generate(100 + i, 0, prompt, 1, {**c.sampling, "max_new_tokens": 4})
                done_at.append(time.monotonic())

        tick = asyncio.create_task(ticker())
        try:
            group = await c.admit()
            await asyncio.gather(group, single_turn())
            assert group.result() is not None, "the blocking episodes are accepted"
            return lag, done_at, time.monotonic()
        finally:
            tick.cancel()
            await c.workflow.aclose()
            await served.close()

    lag, done_at, group_end = asyncio.run(body())
    if processes:
        assert lag < lag_bound_s, lag
        assert max(done_at) < group_end - BLOCK_S, "a single-turn generation waited for an agent"
    else:
        assert lag >= BLOCK_S, lag


def test_a_call_left_running_by_a_rejected_episode_is_aborted_on_the_server(
    random_versions, random_server
):
    """Episode B's call is generating when episode A of the same group raises: the group is
    rejected, B's call cancelled, and its request aborted on the server (not left to run
    its 900 tokens): the server generates nothing more."""
    tokenizer = AutoTokenizer.from_pretrained(random_versions[0])
    starts = iter(range(2))

    async def agent(data, client) -> float:
        if next(starts) == 0:  # A: fails once B's call is surely running
            while await generated(random_server) < base + 20:
                await asyncio.sleep(0.01)
            raise ValueError("A fails")
        await client.chat.completions.create(  # B
            model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=900
        )
        return 1.0

    async def body() -> tuple[list | None, int, dict]:
        served = Served(random_server)
        c = make_controller(agent, [served.client], tokenizer, "rollout.group_size=2")
        c.sampling["ignore_eos"] = True  # B's call runs its 900 tokens unless aborted
        try:
            group = await asyncio.wait_for(run_group(c), 60)
            await asyncio.sleep(0.5)  # the abandon is sent after the group's end
            before = await generated(random_server)
            await asyncio.sleep(0.5)
            return group, await generated(random_server) - before, await served.worker.stats()
        finally:
            await c.workflow.aclose()
            await served.close()

    base = asyncio.run(generated(random_server))
    group, more, stats = asyncio.run(body())
    assert group is None
    assert more == 0
    assert stats["n_abandoned"] == 1 and stats["in_flight"] == 0
