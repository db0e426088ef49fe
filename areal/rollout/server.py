"""The embedded inference server: SGLang's HTTP API (0.5.x shapes) around a DecodeEngine.

```
 rollout worker ──HTTP──► aiohttp handlers ──submit/abort/pause──► DecodeEngine (decode thread)
                 ◄─JSON──   await the request's Future    ◄──────  GenerationResult
```

The rollout worker cannot tell this server from SGLang: same paths, same request fields,
same response shapes, 400 with {"error": {"message": ...}} for a bad request. A handler waits
for its requests' Futures (resolved by the decode thread) or, for pause/continue/update, for
the engine call run in a worker thread; nothing blocks the event loop. /health answers 503
until the model is loaded, which happens after the port is open.

    python -m areal.rollout.server --model DIR --port N [--host 127.0.0.1]
        [--max-batch-size 64] [--max-total-tokens 0] [--seed 0] [--num-threads 1]
        [--weight-version 0] [--api-key KEY] [--weights-root DIR ...] [--events-file F]

With an API key (--api-key, or AREAL_API_KEY in the environment) every request but /health
needs `Authorization: Bearer KEY` (areal/rollout/auth.py); without one the server is open,
as SGLang is. With --weights-root, /update_weights_from_disk loads only from under those.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from areal import events, rolelog
from areal.rollout.activity import ServerActivity
from areal.rollout.auth import API_KEY_ENV, require_api_key, weights_path_problem
from areal.rollout.engine import PAUSE_MODES, DecodeEngine, GenerationResult, SamplingParams

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", dict)

# SGLang sampling parameters this server accepts only at their neutral value.
_NEUTRAL_PARAMS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
    "logit_bias": None,
    "sampling_seed": None,
}
# Presentation-only SGLang parameters: they shape the returned text, not the tokens.
_TEXT_PARAMS = {"skip_special_tokens": True, "spaces_between_special_tokens": True}
_IGNORED_PARAMS = {"stream_interval", "no_stop_trim"}


class BadRequest(ValueError):
    """A client mistake: answered with 400 and this message."""


@dataclass
class GenerateSpec:
    """One request of a (possibly batched) /generate call, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool


# ---- request parsing (pure) ---------------------------------------------------------------


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> tuple[SamplingParams, dict]:
    """SamplingParams plus the text-shaping options, from SGLang's sampling_params dict."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a JSON object, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    text_opts = {"skip_special_tokens": True, "no_stop_trim": False}
    for key, value in raw.items():
        name = f"{where}.{key}"
        if key in ("max_new_tokens", "min_new_tokens", "top_k"):
            kwargs[key] = _int(value, name)
        elif key in ("temperature", "top_p"):
            kwargs[key] = _float(value, name)
        elif key == "ignore_eos":
            kwargs[key] = _bool(value, name)
        elif key == "stop_token_ids":
            kwargs[key] = [] if value is None else _int_list(value, name)
        elif key == "stop":
            kwargs[key] = _stop_strings(value, name)
        elif key in _TEXT_PARAMS or key == "no_stop_trim":
            text_opts[key] = _bool(value, name)
        elif key in _NEUTRAL_PARAMS:
            if value is not None and value != _NEUTRAL_PARAMS[key]:
                raise BadRequest(
                    f"{name}={value!r} is not supported by the embedded server; "
                    f"leave it at {_NEUTRAL_PARAMS[key]!r}"
                )
        elif key not in _IGNORED_PARAMS:
            raise BadRequest(f"{name} is not a known sampling parameter")
    try:
        return SamplingParams(**kwargs), text_opts
    except ValueError as e:
        raise BadRequest(str(e)) from None


def parse_generate_body(body: Any, tokenizer: Any = None) -> tuple[list[GenerateSpec], bool]:
    """Validate a /generate body; returns the requests and whether it was a batch."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded server; send stream=false")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequest("exactly one of text or input_ids must be provided")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids must be a non-empty list of token ids (or of lists)")
        is_batch = isinstance(input_ids[0], list)
        prompts = (
            [_int_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)]
            if is_batch
            else [_int_list(input_ids, "input_ids")]
        )
    else:
        if tokenizer is None:
            raise BadRequest("text needs a tokenizer and the model has none; send input_ids")
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts = [tokenizer.encode(t) for t in texts]
    if any(not p for p in prompts):
        raise BadRequest("input_ids must not contain an empty prompt")
    n = len(prompts)
    sampling = _per_request(body.get("sampling_params"), n, "sampling_params", dict)
    rids = _per_request(body.get("rid"), n, "rid", str)
    logprob = _per_request(body.get("return_logprob", False), n, "return_logprob", bool)
    text_in_lp = _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    specs = []
    for i in range(n):
        where = f"sampling_params[{i}]" if is_batch else "sampling_params"
        params, opts = parse_sampling_params(sampling[i], where)
        specs.append(
            GenerateSpec(
                rid=rids[i] if rids[i] is not None else uuid.uuid4().hex,
                input_ids=prompts[i],
                params=params,
                return_logprob=bool(logprob[i]),
                return_text_in_logprobs=text_in_lp,
                skip_special_tokens=opts["skip_special_tokens"],
                no_stop_trim=opts["no_stop_trim"],
            )
        )
    if len({s.rid for s in specs}) < n:
        raise BadRequest("rid must be unique within a batch")
    return specs, is_batch


def format_generate_output(result: GenerationResult, spec: GenerateSpec, tokenizer: Any) -> dict:
    """The SGLang /generate response for one finished request."""
    matched = result.finish_reason.get("matched")
    text_ids = result.output_ids
    if isinstance(matched, int) and not spec.no_stop_trim and text_ids:
        text_ids = text_ids[:-1]  # SGLang leaves the matched stop token out of the text
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(text_ids, skip_special_tokens=spec.skip_special_tokens)
        if isinstance(matched, str) and not spec.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
    # The keys and order of SGLang's TokenizerManager._handle_batch_output (metrics off); see
    # tests/data/sglang_shapes.json.
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "weight_version": result.weight_version,
        "num_retractions": 0,
    }
    if spec.return_logprob:

        def texts(ids: list[int]) -> list[str | None]:
            if spec.return_text_in_logprobs and tokenizer is not None:
                return [tokenizer.decode([t]) for t in ids]
            return [None] * len(ids)

        # By default SGLang starts input log-probs at the last prompt token, which has none.
        last = result.prompt_ids[-1:]
        meta["input_token_logprobs"] = [
            [None, t, x] for t, x in zip(last, texts(last), strict=True)
        ]
        meta["output_token_logprobs"] = [
            [lp, tok, txt]
            for lp, tok, txt in zip(
                result.logprobs, result.output_ids, texts(result.output_ids), strict=True
            )
        ]
        meta["output_token_logprobs_length"] = len(result.output_ids)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(result.output_ids)
    meta["cached_tokens"] = 0
    meta["e2e_latency"] = result.e2e_latency
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


# ---- handlers -----------------------------------------------------------------------------


def _state(request: web.Request) -> dict:
    return request.app[ENGINE_KEY]


def _engine(request: web.Request) -> DecodeEngine:
    engine = _state(request).get("engine")
    if engine is None:
        raise web.HTTPServiceUnavailable(text="the model is still loading")
    return engine


async def _json(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def generate(request: web.Request) -> web.Response:
    activity: ServerActivity = _state(request)["activity"]
    activity.request_started()  # the timeline's generate spans (areal/rollout/activity.py)
    try:
        return await _generate(request)
    finally:
        activity.request_finished()


async def _generate(request: web.Request) -> web.Response:
    engine = _engine(request)
    specs, is_batch = parse_generate_body(await _json(request), engine.tokenizer)
    futures = []
    try:
        for spec in specs:
            futures.append(
                asyncio.wrap_future(engine.submit(spec.rid, spec.input_ids, spec.params))
            )
    except ValueError as e:
        for spec in specs[: len(futures)]:
            engine.abort(rid=spec.rid)
        raise BadRequest(str(e)) from None
    except RuntimeError as e:  # shutting down
        raise web.HTTPServiceUnavailable(text=str(e)) from None
    pending = set(futures)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending and (request.transport is None or request.transport.is_closing()):
            # The client went away (SGLang does the same): free the batch slots.
            for spec in specs:
                engine.abort(rid=spec.rid, message="The client disconnected.")
    outputs = [
        format_generate_output(f.result(), spec, engine.tokenizer)
        for f, spec in zip(futures, specs, strict=True)
    ]
    return web.json_response(outputs if is_batch else outputs[0])


async def pause_generation(request: web.Request) -> web.Response:
    engine = _engine(request)
    mode = (await _json(request)).get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    _state(request)["activity"].paused()
    await asyncio.to_thread(engine.pause, mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    engine = _engine(request)
    await _json(request)
    await asyncio.to_thread(engine.continue_generation)
    _state(request)["activity"].continued()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = _engine(request)
    body = await _json(request)
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise BadRequest("model_path must be a non-empty string")
    problem = weights_path_problem(model_path, _state(request)["weight_roots"])
    if problem:
        logger.warning("refused to load weights: %s", problem)
        return web.json_response(
            {"success": False, "message": problem, "num_paused_requests": 0}, status=400
        )
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str | int):
        raise BadRequest("weight_version must be a string or null")
    abort_all = _bool(body.get("abort_all_requests", False), "abort_all_requests")
    _bool(body.get("flush_cache", True), "flush_cache")  # no cache to flush, but check it
    with _state(request)["activity"].loading(version, interrupting=abort_all):
        success, message, num_paused = await asyncio.to_thread(
            engine.update_weights,
            model_path,
            None if version is None else str(version),
            abort_all,
        )
    content = {"success": success, "message": message, "num_paused_requests": num_paused}
    return web.json_response(content, status=200 if success else 400)


async def abort_request(request: web.Request) -> web.Response:
    engine = _engine(request)
    body = await _json(request)
    rid = body.get("rid", "")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    abort_all = _bool(body.get("abort_all", False), "abort_all")
    if abort_all or rid:
        engine.abort(rid=rid, abort_all=abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    _engine(request)
    # There is no prefix cache to flush; SGLang's text, as clients may log it.
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n"
    )


async def health(request: web.Request) -> web.Response:
    engine = _state(request).get("engine")
    return web.Response(status=200 if engine is not None and engine.is_alive() else 503)


async def model_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": _state(request)["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
        }
    )


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": _engine(request).weight_version})


async def server_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    # SGLang's is {**server_args, **scheduler_info, "internal_states": [...], "version"}; the
    # counters are also at the top level for tools that read them there.
    stats = engine.stats()
    info = {
        "model_path": engine.model_path,
        "tokenizer_path": _state(request)["tokenizer_path"],
        "context_length": engine.context_len,
        "weight_version": engine.weight_version,
        "max_running_requests": engine.max_batch_size,
        "internal_states": [stats],
        "version": "areal-embedded",
        **stats,
    }
    return web.json_response(info)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Client mistakes become 400 with SGLang's error body, never a 500 with a traceback."""
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response({"error": {"message": str(e)}}, status=400)
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": {"message": f"internal error: {e}"}}, status=500)


def create_app(
    tokenizer_path: str, api_key: str | None = None, weight_roots: list[str] | None = None
) -> web.Application:
    """The application; put the engine at app[ENGINE_KEY]["engine"] once it is loaded."""
    middlewares = [require_api_key(api_key), _errors] if api_key else [_errors]
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    state: dict = {
        "engine": None, "tokenizer_path": tokenizer_path, "weight_roots": weight_roots or [],
    }  # fmt: skip
    state["activity"] = ServerActivity(lambda: getattr(state["engine"], "weight_version", None))
    app[ENGINE_KEY] = state
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/abort_request", abort_request)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_get("/get_server_info", server_info)
    return app


# ---- field checks -------------------------------------------------------------------------


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise BadRequest(f"{name} must be a list of integers")
    return value


def _stop_strings(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise BadRequest(f"{name} must be a string or a list of strings")
    return values


def _per_request(value: Any, n: int, name: str, kind: type) -> list[Any]:
    """SGLang lets a batch give one value for all requests or a list with one per request."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} requests")
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise BadRequest(f"{name} must be a {kind.__name__}, got {v!r}")
    return values


# ---- entry point --------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> int:
    app = create_app(args.model, args.api_key, args.weights_root)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        print(f"cannot listen on {args.host}:{args.port}: {e}; pick a free port", file=sys.stderr)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        engine = await asyncio.to_thread(
            DecodeEngine,
            args.model,
            max_batch_size=args.max_batch_size,
            max_total_tokens=args.max_total_tokens,
            seed=args.seed,
            num_threads=args.num_threads,
            weight_version=args.weight_version,
        )
    except (OSError, ValueError) as e:
        print(f"cannot load the model from {args.model}: {e}", file=sys.stderr)
        await runner.cleanup()
        return 1
    app[ENGINE_KEY]["engine"] = engine
    rolelog.set_context(version=lambda: engine.weight_version)
    print(f"areal embedded server ready at http://{args.host}:{args.port}", flush=True)
    await stop.wait()
    logger.info("shutting down")
    engine.shutdown()  # resolves every waiting handler with an abort before the site closes
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=0,
        help="KV-cache budget in tokens (rows x longest request); 0: a quarter of free memory",
    )
    parser.add_argument("--weight-version", default="0")
    parser.add_argument(
        "--events-file", help="record generate/pause/load spans here (areal/events.py)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV}; none = open)",
    )  # fmt: skip
    parser.add_argument(
        "--weights-root", action="append", default=[],
        help="load weights only from under this directory (repeatable; none = anywhere)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.events_file:
        events.configure(args.events_file, Path(args.events_file).stem)
    rolelog.setup(Path(args.events_file).stem if args.events_file else "server")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
