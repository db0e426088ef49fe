"""Request builders and response parsers of the SGLang client, without a server."""

from __future__ import annotations

import copy

import pytest

from areal.rollout.client import (
    GenerateOutput,
    build_generate_request,
    error_message,
    parse_generate_response,
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
