"""The embedded server as a real subprocess on loopback, driven by the rollout worker's client.

One server (tiny model, random weights) serves the whole module; tests run in file order and
the weight-update test, which changes the served weights, comes last and restores them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.client import SGLangClient
from areal.rollout.sglang_api import (
    build_destroy_weights_group_request,
    build_init_weights_group_request,
    build_update_weights_from_distributed_request,
)
from tests.system.conftest import copy_weights, embedded_server, ref_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", warmup_steps=0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with embedded_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, f"What is {i} plus {2 * i + 1}?") for i in range(16)]


def run(coro_fn, url: str):
    """Run coro_fn(client) on a fresh loop with a fresh client."""

    async def main():
        client = SGLangClient(url, timeout=60)
        try:
            return await asyncio.wait_for(coro_fn(client), 60)
        finally:
            await client.close()

    return asyncio.run(main())


async def raw(method: str, url: str, **kwargs) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, **kwargs) as resp:
            return resp.status, await resp.read()


async def info(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_server_info") as resp:
            return await resp.json()


async def wait_for_info(url: str, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while not predicate(current := await info(url)):
        assert time.monotonic() < deadline, f"server never reached the state; last: {current}"
        await asyncio.sleep(0.01)
    return current


LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}


def test_health_and_model_info(server, model_dir):
    async def body(client: SGLangClient):
        assert await client.health()
        for path in ("/health", "/health_generate"):
            assert await raw("GET", server + path) == (200, b"")
        await client.wait_healthy(timeout=5)
        assert await client.model_info() == {
            "model_path": str(model_dir),
            "tokenizer_path": str(model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "0",
        }
        status, text = await raw("GET", server + "/flush_cache")
        assert status == 200 and text.startswith(b"Cache flushed.")
        assert (await client.flush_cache()).startswith("Cache flushed.")

    run(body, server)


def test_generate_response_shape(server, prompts, tokenizer):
    prompt = prompts[0]

    async def body(client: SGLangClient):
        params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
        payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        status, data = await raw("POST", server + "/generate", json={**payload, "rid": "shape-1"})
        assert status == 200
        out = json.loads(data)
        assert set(out) == {"text", "output_ids", "meta_info"}
        ids = out["output_ids"]
        assert len(ids) == 5 and all(isinstance(t, int) for t in ids)
        assert out["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        meta = out["meta_info"]
        assert meta["id"] == "shape-1"
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), 5)
        assert meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
        logprobs = meta["output_token_logprobs"]
        assert [entry[1:] for entry in logprobs] == [[t, None] for t in ids]
        assert all(isinstance(entry[0], float) and entry[0] <= 0 for entry in logprobs)

        # Without return_logprob there are no log-probs; a stop token gives a stop reason.
        greedy = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        status, data = await raw(
            "POST", server + "/generate", json={"input_ids": prompt, "sampling_params": greedy}
        )
        first = json.loads(data)
        assert "output_token_logprobs" not in first["meta_info"]
        stop_at = first["output_ids"][1]
        stopping = {"max_new_tokens": 3, "temperature": 0.0, "stop_token_ids": [stop_at]}
        out = await client.generate(prompt, stopping, rid="shape-2")
        assert out.output_ids == first["output_ids"][: first["output_ids"].index(stop_at) + 1]
        assert (out.finish_reason, out.rid, out.weight_version) == ("stop", "shape-2", 0)
        status, data = await raw(
            "POST", server + "/generate", json={"input_ids": prompt, "sampling_params": stopping}
        )
        assert json.loads(data)["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": stop_at,
        }

        # Text in, like SGLang.
        status, data = await raw(
            "POST",
            server + "/generate",
            json={"text": "What is 1 plus 2?", "sampling_params": {"max_new_tokens": 2}},
        )
        meta = json.loads(data)["meta_info"]
        assert status == 200 and meta["prompt_tokens"] == len(tokenizer.encode("What is 1 plus 2?"))

    run(body, server)


def test_batch_generate(server, prompts):
    batch = prompts[:3]

    async def body(client: SGLangClient):
        payload = {
            "input_ids": batch,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "rid": ["b0", "b1", "b2"],
            "return_logprob": True,
        }
        status, data = await raw("POST", server + "/generate", json=payload)
        outs = json.loads(data)
        assert status == 200 and isinstance(outs, list) and len(outs) == 3
        for out, prompt, rid in zip(outs, batch, payload["rid"], strict=True):
            assert out["meta_info"]["id"] == rid
            assert out["meta_info"]["prompt_tokens"] == len(prompt)
            assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) == 4

    run(body, server)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
        {"temperature": 1.3},
        {"temperature": 0.0},  # greedy: log-probs at temperature 1
    ],
)
def test_logprobs_match_a_plain_forward_pass(server, prompts, ref_model, params):
    async def body(client: SGLangClient):
        sampling = {**params, "max_new_tokens": 12, "ignore_eos": True}
        return await asyncio.gather(*(client.generate(p, sampling) for p in prompts[:4]))

    outs = run(body, server)
    temperature = params["temperature"] or 1.0
    for prompt, out in zip(prompts, outs, strict=False):
        expected = ref_logprobs(ref_model, prompt, out.output_ids, temperature)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_equals_transformers_generate(server, prompts, ref_model):
    async def body(client: SGLangClient):
        greedy = {"max_new_tokens": 12, "temperature": 0.0}
        return await asyncio.gather(*(client.generate(p, greedy) for p in prompts[:4]))

    outs = run(body, server)
    for prompt, out in zip(prompts, outs, strict=False):
        with torch.no_grad():
            generated = ref_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12
            )[0, len(prompt) :].tolist()
        if out.output_ids != generated:
            # Only a tie within float noise may differ: check the logit gap where they part.
            pairs = zip(out.output_ids, generated, strict=False)
            i = next((i for i, (a, b) in enumerate(pairs) if a != b), len(out.output_ids))
            with torch.no_grad():
                logits = ref_model(torch.tensor([prompt + generated[:i]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] < 1e-4, (out.output_ids, generated)


def test_concurrent_requests_are_batched(server, prompts):
    async def body(client: SGLangClient):
        before = await info(server)
        outs = await asyncio.gather(
            *(
                client.generate(p, {"max_new_tokens": n, "ignore_eos": True}, rid=f"c{n}")
                for n, p in enumerate(prompts, start=1)
            )
        )
        after = await info(server)
        return outs, after["num_decode_steps"] - before["num_decode_steps"]

    outs, steps = run(body, server)
    assert [len(o.output_ids) for o in outs] == list(range(1, 17))
    assert all(o.finish_reason == "length" and o.rid == f"c{n}" for n, o in enumerate(outs, 1))
    # 136 tokens in far fewer forward passes: requests shared decode steps.
    assert steps < 136 / 2


def test_pause_abort_returns_partial_outputs_and_holds_new_requests(server, prompts):
    async def body(client: SGLangClient):
        start = (await info(server))["total_generated_tokens"]
        tasks = [asyncio.create_task(client.generate(p, LONG)) for p in prompts[:4]]
        await wait_for_info(
            server,
            lambda s: s["num_running_reqs"] == 4 and s["total_generated_tokens"] >= start + 8,
        )
        await client.pause_generation("abort")
        outs = await asyncio.gather(*tasks)
        for out in outs:
            assert out.finish_reason == "abort" and "pause" in out.message
            assert 0 < len(out.output_ids) < 400 and len(out.logprobs) == len(out.output_ids)

        late = asyncio.create_task(client.generate(prompts[5], {"max_new_tokens": 3}))
        # The server has the request (held) before we look: not done means held, not unsent.
        state = await wait_for_info(server, lambda s: s["num_held_reqs"] == 1)
        assert not late.done()
        assert (state["paused"], state["num_held_reqs"], state["num_running_reqs"]) == (
            "abort",
            1,
            0,
        )
        await client.continue_generation()
        out = await late
        assert out.finish_reason in ("stop", "length") and len(out.output_ids) >= 1

    run(body, server)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_in_place_keeps_requests_and_resumes_them(server, model_dir, prompts, mode):
    async def body(client: SGLangClient):
        start = (await info(server))["total_generated_tokens"]
        params = {"max_new_tokens": 150, "ignore_eos": True}
        tasks = [asyncio.create_task(client.generate(p, params)) for p in prompts[:2]]
        t0 = time.monotonic()
        await wait_for_info(
            server,
            lambda s: s["num_running_reqs"] == 2 and s["total_generated_tokens"] >= start + 4,
        )
        four_tokens_s = time.monotonic() - t0
        await client.pause_generation(mode)
        frozen = await info(server)
        # Long enough for at least 12 more tokens at the pace just measured, however loaded
        # the machine: an unpaused server would have moved.
        await asyncio.sleep(max(0.3, 3 * four_tokens_s))
        still = await info(server)
        assert still["total_generated_tokens"] == frozen["total_generated_tokens"]
        assert still["num_running_reqs"] + still["num_waiting_reqs"] == 2
        assert not any(t.done() for t in tasks)
        # While paused an update applies at once; the kept requests finish on the new
        # version and report it (same weights here, so later tests see the same model).
        result = await client.update_weights_from_disk(str(model_dir), 7)
        assert result["num_paused_requests"] == 2
        await client.continue_generation()
        outs = await asyncio.gather(*tasks)
        assert [(o.finish_reason, len(o.output_ids)) for o in outs] == [("length", 150)] * 2
        assert [o.weight_version for o in outs] == [7, 7]
        await client.update_weights_from_disk(str(model_dir), 0)

    run(body, server)


def test_abort_request_by_rid(server, prompts):
    async def body(client: SGLangClient):
        victim = asyncio.create_task(client.generate(prompts[0], LONG, rid="victim"))
        await wait_for_info(server, lambda s: s["num_running_reqs"] == 1)
        bystander = asyncio.create_task(
            client.generate(prompts[1], {"max_new_tokens": 8, "ignore_eos": True}, rid="by")
        )
        await client.abort_request(rid="no-such-request")
        await client.abort_request(rid="victim")
        out = await victim
        assert out.finish_reason == "abort" and out.rid == "victim"
        assert len(out.output_ids) < 400
        other = await bystander
        assert (other.finish_reason, len(other.output_ids)) == ("length", 8)

    run(body, server)


def test_client_disconnect_aborts_its_request(server, prompts):
    async def body(client: SGLangClient):
        before = (await info(server))["total_aborted_reqs"]
        payload = {"input_ids": prompts[0], "sampling_params": LONG}
        # Held by a pause, the request is still in flight when the client gives up, however
        # fast the engine decodes.
        await client.pause_generation("in_place")
        try:
            with pytest.raises(asyncio.TimeoutError):
                await raw(
                    "POST", server + "/generate", json=payload, timeout=aiohttp.ClientTimeout(0.3)
                )
            # The handler notices the closed connection within a second and frees the slot.
            await wait_for_info(
                server,
                lambda s: s["total_aborted_reqs"] == before + 1 and s["num_held_reqs"] == 0,
            )
        finally:
            await client.continue_generation()

    run(body, server)


def test_wait_healthy_fails_fast_when_the_server_process_dies():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def body(client: SGLangClient):
        assert not await client.health()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited with code 3"):
            await client.wait_healthy(timeout=30, proc=proc)
        assert time.monotonic() - started < 15

    run(body, f"http://127.0.0.1:{port}")


def test_malformed_requests_get_400_naming_the_field(server, prompts):
    cases = [
        ("/generate", b"{not json", "not valid JSON"),
        ("/generate", {"input_ids": "abc"}, "input_ids"),
        ("/generate", {}, "text or input_ids"),
        ("/generate", {"input_ids": [prompts[0], "x"]}, "input_ids[1]"),
        ("/generate", {"input_ids": [10**6]}, "vocabulary"),
        ("/generate", {"input_ids": [1], "stream": True}, "stream"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 4}}, "sampling_params.n"),
        ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/abort_request", {"rid": 5}, "rid"),
    ]

    async def body(client: SGLangClient):
        for path, payload, field in cases:
            kwargs = {"data": payload} if isinstance(payload, bytes) else {"json": payload}
            status, data = await raw("POST", server + path, **kwargs)
            message = json.loads(data)["error"]["message"]
            assert status == 400 and field in message, (path, payload, status, data)
        with pytest.raises(RuntimeError, match="HTTP 400.*max_new_tokens"):
            await client.generate(prompts[0], {"max_new_tokens": -1})
        assert await client.health()  # nothing broke

    run(body, server)


SHAPES = json.loads((Path(__file__).parents[1] / "data" / "sglang_shapes.json").read_text())


def _split_top(text: str, sep: str) -> list[str]:
    """text split at `sep` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _matches(value, kind: str) -> bool:
    """Whether a JSON value has the type `kind` of sglang_shapes.json."""
    options = _split_top(kind, "|")
    if len(options) > 1:
        return any(_matches(value, option) for option in options)
    simple = {"str": str, "bool": bool, "null": type(None), "float": float}
    if kind == "any":
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in simple:
        return isinstance(value, simple[kind])
    if kind.startswith("list[") and kind.endswith("]"):
        return isinstance(value, list) and all(_matches(v, kind[5:-1]) for v in value)
    if kind.startswith("tuple[") and kind.endswith("]"):
        items = _split_top(kind[6:-1], ",")
        return (
            isinstance(value, list)
            and len(value) == len(items)
            and all(_matches(v, k) for v, k in zip(value, items, strict=True))
        )
    raise AssertionError(f"unknown type {kind!r} in sglang_shapes.json")


def assert_shape(value, shape, where: str = "", exact: bool = True) -> None:
    """value has exactly the keys of `shape` (at least them, if not exact), each of its type."""
    if shape == "finish_reason":
        assert isinstance(value, dict) and value.get("type") in SHAPES["finish_reason"], where
        shape = SHAPES["finish_reason"][value["type"]]
    if isinstance(shape, dict):
        assert isinstance(value, dict), f"{where} is {value!r}, not an object"
        missing, extra = set(shape) - set(value), set(value) - set(shape)
        assert not missing, f"{where or 'response'} lacks SGLang's {sorted(missing)}"
        assert not exact or not extra, f"{where or 'response'} has {sorted(extra)}, SGLang not"
        for key, kind in shape.items():
            assert_shape(value[key], kind, f"{where}.{key}".lstrip("."))
    else:
        assert _matches(value, shape), f"{where}={value!r} is not {shape}"


def test_responses_match_sglang_field_for_field(server, model_dir, prompts):
    async def body(client: SGLangClient):
        greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        for params, extra in [
            (greedy, {}),
            ({**greedy, "stop_token_ids": []}, {"return_text_in_logprobs": True}),
        ]:
            payload = {"input_ids": prompts[1], "sampling_params": params, "return_logprob": True}
            status, data = await raw("POST", server + "/generate", json={**payload, **extra})
            assert status == 200
            assert_shape(json.loads(data), SHAPES["generate"])
        first = json.loads(data)["output_ids"][0]
        stop = {"max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": [first]}
        payload = {"input_ids": prompts[1], "sampling_params": stop, "return_logprob": True}
        status, data = await raw("POST", server + "/generate", json=payload)
        out = json.loads(data)
        assert_shape(out, SHAPES["generate"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        assert out["meta_info"]["input_token_logprobs"] == [[None, prompts[1][-1], None]]
        assert out["meta_info"]["output_token_logprobs_length"] == 1

        # Aborted mid-generation: the abort reason's shape.
        payload = {"input_ids": prompts[2], "sampling_params": LONG, "return_logprob": True}
        task = asyncio.create_task(raw("POST", server + "/generate", json={**payload, "rid": "s"}))
        await wait_for_info(server, lambda s: s["num_running_reqs"] == 1)
        await client.abort_request("s")
        status, data = await task
        aborted = json.loads(data)
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert_shape(aborted, SHAPES["generate"])

        # Reloading the same weights under the same version: the update answer's shape.
        status, data = await raw(
            "POST",
            server + "/update_weights_from_disk",
            json={"model_path": str(model_dir), "weight_version": "0"},
        )
        assert status == 200
        assert_shape(json.loads(data), SHAPES["update_weights_from_disk"])
        for path, shape in [("/model_info", "model_info"), ("/get_weight_version", None)]:
            status, data = await raw("GET", server + path)
            assert_shape(json.loads(data), SHAPES[shape or path[1:]])
        status, data = await raw("GET", server + "/get_server_info")
        assert_shape(json.loads(data), SHAPES["server_info_required"], exact=False)

    run(body, server)


def test_weight_group_requests_and_refusals_match_sglang(server):
    """The weight-update group routes (a whole broadcast: tests/system/test_weight_broadcast.py):
    our requests have SGLang's fields, and a refusal is SGLang's {success, message} with 400."""
    requests = {
        "init_weights_update_group": build_init_weights_group_request(
            "127.0.0.1", 29500, 1, 2, "g", backend="mpi"
        ),
        "update_weights_from_distributed": build_update_weights_from_distributed_request(
            ["model.norm.weight"], ["float32"], [[64]], "g", 1
        ),
        "destroy_weights_update_group": build_destroy_weights_group_request("g"),
    }

    async def body(client: SGLangClient):
        messages = {}
        for route, request in requests.items():
            assert_shape(request, SHAPES[f"{route}_request"])
            # No group "g" exists and backend "mpi" is not ours: each is refused at once.
            status, data = await raw("POST", f"{server}/{route}", json=request)
            answer = json.loads(data)
            assert status == 400 and answer["success"] is False, answer
            assert_shape(answer, SHAPES[route])
            messages[route] = answer["message"]
        assert "backend must be one of gloo, nccl" in messages["init_weights_update_group"]
        assert "no weight-update group named 'g'" in messages["update_weights_from_distributed"]
        with pytest.raises(RuntimeError, match="no weight-update group named 'g'"):
            await client.destroy_weights_update_group("g")
        assert await client.health()

    run(body, server)


def test_flush_cache_answers_plain_text_and_keeps_generating(server, prompts):
    async def body(client: SGLangClient):
        greedy = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        before = await client.generate(prompts[3], greedy)
        for method in ("POST", "GET"):
            async with aiohttp.ClientSession() as session:
                async with session.request(method, server + "/flush_cache") as resp:
                    assert resp.status == 200
                    assert resp.content_type == "text/plain"
                    assert (await resp.text()).startswith("Cache flushed.\n")
        assert (await client.flush_cache()).startswith("Cache flushed.")
        after = await client.generate(prompts[3], greedy)
        assert (after.output_ids, after.logprobs) == (before.output_ids, before.logprobs)

    run(body, server)


def test_update_weights_from_disk(server, model_dir, prompts, ref_model, tmp_path):
    def scale_norm(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 3

    new_dir = copy_weights(model_dir, tmp_path / "v1", scale_norm)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    bad_shape = copy_weights(
        model_dir, tmp_path / "bad", lambda t: t.update({"model.norm.weight": torch.ones(7)})
    )
    missing = copy_weights(model_dir, tmp_path / "missing", lambda t: t.pop("model.norm.weight"))
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}

    async def body(client: SGLangClient):
        result = await client.update_weights_from_disk(str(new_dir), 1)
        assert result["success"] and "Weight version updated to 1" in result["message"]
        assert result["num_paused_requests"] == 0
        out = await client.generate(prompts[0], sampling)
        assert out.weight_version == 1
        info_now = await client.model_info()
        assert (info_now["weight_version"], info_now["model_path"]) == ("1", str(new_dir))

        # Refused updates name the problem and change nothing.
        with pytest.raises(RuntimeError, match=str(tmp_path / "nowhere")):
            await client.update_weights_from_disk(str(tmp_path / "nowhere"), 2)
        status, data = await raw(
            "POST",
            server + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "nowhere"), "weight_version": "2"},
        )
        refused = json.loads(data)
        assert status == 400 and refused["success"] is False
        assert str(tmp_path / "nowhere") in refused["message"]
        with pytest.raises(RuntimeError, match=r"model\.norm\.weight has shape \(7,\)"):
            await client.update_weights_from_disk(str(bad_shape), 2)
        with pytest.raises(RuntimeError, match=r"missing tensor model\.norm\.weight"):
            await client.update_weights_from_disk(str(missing), 2)
        assert (await client.model_info())["weight_version"] == "1"

        # Without a pause, an update waits for running requests: they finish on version 1.
        running = asyncio.create_task(
            client.generate(prompts[1], {"max_new_tokens": 200, "ignore_eos": True})
        )
        await wait_for_info(server, lambda s: s["num_running_reqs"] == 1)
        await client.update_weights_from_disk(str(new_dir), 2)
        finished = await running
        assert (finished.finish_reason, finished.weight_version) == ("length", 1)

        # abort_all_requests aborts what runs, then restores the original weights.
        victim = asyncio.create_task(client.generate(prompts[2], LONG))
        await wait_for_info(server, lambda s: s["num_running_reqs"] == 1)
        await client.update_weights_from_disk(str(model_dir), 3, abort_all_requests=True)
        aborted = await victim
        assert (aborted.finish_reason, aborted.weight_version) == ("abort", 2)
        restored = await client.generate(prompts[0], sampling)
        assert restored.weight_version == 3
        return out, restored

    out, restored = run(body, server)
    expected_new = ref_logprobs(new_model, prompts[0], out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), expected_new, atol=1e-4, rtol=0)
    expected_old = ref_logprobs(ref_model, prompts[0], out.output_ids, 1.0)
    assert (torch.tensor(out.logprobs) - expected_old).abs().max() > 1e-2
    expected_restored = ref_logprobs(ref_model, prompts[0], restored.output_ids, 1.0)
    assert torch.allclose(torch.tensor(restored.logprobs), expected_restored, atol=1e-4, rtol=0)
