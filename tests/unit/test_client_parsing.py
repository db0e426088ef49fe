"""Request builders and response parsers of the SGLang client (sglang_api.py), without a
server."""

from __future__ import annotations

import copy

import pytest

from areal.config import ConfigError
from areal.rollout.backends import load_backend, names
from areal.rollout.generation import GenerationResult
from areal.rollout.http_error import BadRequest
from areal.rollout.inference import GenerateOutput, InferenceClient
from areal.rollout.sglang_api import (
    build_generate_request,
    build_update_weights_request,
    error_message,
    format_generate_output,
    format_weight_version,
    parse_generate_body,
    parse_generate_response,
    parse_update_weights_body,
    parse_weight_version,
)


def _body(finish_reason: dict, output_ids=(5, 7, 2), weight_version="3") -> dict:
    return {
        "text": "ab",
        "output_ids": list(output_ids),
        "meta_info": {
            "id": "r1",
            "finish_reason": finish_reason,
            "prompt_tokens": 4,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(output_ids)],
        },
    }


def test_build_generate_request_asks_for_token_logprobs():
    body = build_generate_request([1, 2, 3], {"max_new_tokens": 4, "temperature": 1.0}, "r9")
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
        "return_logprob": True,
        "stream": False,
        "rid": "r9",
    }
    assert "rid" not in build_generate_request([1], {}, None)


def test_build_generate_request_copies_its_inputs():
    params = {"max_new_tokens": 4}
    body = build_generate_request([1], params)
    body["sampling_params"]["max_new_tokens"] = 99
    assert params == {"max_new_tokens": 4}
    with pytest.raises(ValueError, match="input_ids"):
        build_generate_request([], params)


@pytest.mark.parametrize(
    "reason, kind, message",
    [
        ({"type": "stop", "matched": 2}, "stop", ""),
        ({"type": "stop", "matched": "</answer>"}, "stop", ""),
        ({"type": "length", "length": 3}, "length", ""),
        (
            {"type": "abort", "message": "Aborted by pause_generation."},
            "abort",
            "Aborted by pause_generation.",
        ),
    ],
)
def test_parse_every_finish_reason(reason, kind, message):
    assert parse_generate_response(_body(reason)) == GenerateOutput(
        output_ids=[5, 7, 2],
        logprobs=[-0.5, -1.5, -2.5],
        finish_reason=kind,
        weight_version=3,
        completion_tokens=3,
        rid="r1",
        message=message,
    )


def test_parse_abort_with_no_output():
    out = parse_generate_response(_body({"type": "abort", "message": "x"}, output_ids=()))
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([], [], "abort")


@pytest.mark.parametrize(
    "value, expected", [("default", 0), ("0", 0), ("12", 12), (7, 7), ("v000007", 7)]
)
def test_weight_version_strings(value, expected):
    assert parse_weight_version(value) == expected
    assert (
        parse_generate_response(_body({"type": "length"}, weight_version=value)).weight_version
        == expected
    )


@pytest.mark.parametrize("value", ["latest", "", None, 1.5, True])
def test_weight_version_rejects_non_integers(value):
    with pytest.raises(ValueError, match="weight_version"):
        parse_weight_version(value)


def _without(path: str) -> dict:
    body = _body({"type": "length", "length": 3})
    node = body
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    del node[last]
    return body


@pytest.mark.parametrize(
    "path",
    [
        "output_ids",
        "meta_info",
        "meta_info.finish_reason",
        "meta_info.finish_reason.type",
        "meta_info.weight_version",
        "meta_info.output_token_logprobs",
    ],
)
def test_missing_fields_are_named(path):
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        parse_generate_response(_without(path))


def test_malformed_bodies():
    good = _body({"type": "length", "length": 3})
    with pytest.raises(ValueError, match="JSON object"):
        parse_generate_response([good])
    unfinished = copy.deepcopy(good)
    unfinished["meta_info"]["finish_reason"] = None  # a streaming chunk, not a result
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response(unfinished)
    odd = copy.deepcopy(good)
    odd["meta_info"]["finish_reason"] = {"type": "eos"}
    with pytest.raises(ValueError, match="finish_reason.type"):
        parse_generate_response(odd)
    short = copy.deepcopy(good)
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="2 entries for 3 output_ids"):
        parse_generate_response(short)
    swapped = copy.deepcopy(good)
    swapped["meta_info"]["output_token_logprobs"][1][1] = 8
    with pytest.raises(ValueError, match=r"output_token_logprobs\[1\]"):
        parse_generate_response(swapped)
    wrong_type = copy.deepcopy(good)
    wrong_type["output_ids"] = "5 7 2"
    with pytest.raises(ValueError, match="output_ids must be a list"):
        parse_generate_response(wrong_type)


def test_error_message_reads_both_sglang_error_shapes():
    assert error_message({"error": {"message": "bad input_ids"}}) == "bad input_ids"
    assert error_message({"object": "error", "message": "bad mode", "code": 400}) == "bad mode"
    assert error_message({"success": False, "message": "no dir /x"}) == "no dir /x"
    assert error_message("plain text") == "plain text"


# ---- both halves of the contract: what the embedded server writes, the client reads ------


@pytest.mark.parametrize("version", [0, 7, 123])
def test_weight_version_round_trips_through_the_wire(version):
    assert format_weight_version(version) == str(version)
    assert parse_weight_version(format_weight_version(version)) == version


@pytest.mark.parametrize("value, expected", [("default", 0), ("v7", 7), (3, 3), (None, None)])
def test_the_server_reads_weight_versions_as_the_client_does(value, expected):
    body = {"model_path": "/w/v7", "weight_version": value, "abort_all_requests": True}
    assert parse_update_weights_body(body) == ("/w/v7", expected, True)
    if value is not None:
        assert parse_update_weights_body(build_update_weights_request("/w", expected))[1] == (
            expected
        )


def test_the_server_refuses_a_non_integer_weight_version():
    with pytest.raises(BadRequest, match="weight_version 'latest'") as refused:
        parse_update_weights_body({"model_path": "/w", "weight_version": "latest"})
    assert refused.value.status == 400


def test_a_formatted_generate_output_parses_back():
    result = GenerationResult(
        rid="r2",
        prompt_ids=[1, 2],
        output_ids=[5, 7],
        logprobs=[-0.25, -1.0],
        finish_reason={"type": "stop", "matched": 7},
        weight_version=4,
        e2e_latency=0.1,
    )
    (spec,), _ = parse_generate_body(
        {"input_ids": [1, 2], "return_logprob": True, "rid": "r2"}, tokenizer=None
    )
    body = format_generate_output(result, spec, tokenizer=None)
    assert body["meta_info"]["weight_version"] == "4"  # a string on the wire, as SGLang's
    assert parse_generate_response(body) == GenerateOutput(
        output_ids=[5, 7],
        logprobs=[-0.25, -1.0],
        finish_reason="stop",
        weight_version=4,
        completion_tokens=2,
        rid="r2",
    )


def test_each_backend_gives_its_client():
    assert names() == ("embedded", "sglang", "vllm")
    for backend in names():
        factory = load_backend(backend).client()
        assert isinstance(factory("http://127.0.0.1:1/", api_key="k"), InferenceClient)
    assert load_backend("vllm").client().__name__ == "VLLMClient"
    with pytest.raises(ConfigError, match="unknown inference backend 'trt'"):
        load_backend("trt")
