"""The embedded inference server: SGLang's HTTP API (0.5.x shapes) around a DecodeEngine.

```
 rollout worker ──HTTP──► aiohttp handler ──api.parse_*──► submit/abort/pause ──► DecodeEngine
                 ◄─JSON── api.format_*(result) ◄── await the request's Future ◄── (decode thread)
```

The rollout worker cannot tell this server from SGLang: same paths, same request fields,
same response shapes, 400 with {"error": {"message": ...}} for a bad request. Those shapes
are sglang_api.py's (`api`): this module holds only the handlers and the engine's wiring,
and weight versions are the engine's integers, strings only on the wire. A handler waits
for its requests' Futures (resolved by the decode thread) or, for pause/continue/update, for
the DecodeEngine call run in a worker thread; nothing blocks the event loop. /health answers 503
until the model is loaded, which happens after the port is open.

Weights also arrive over a weight-update group (SGLang's routes; areal/weight_group.py), the
trainer being rank 0 and this server one rank (gloo; nccl on cuda):

    /init_weights_update_group ──► joined (waits for every rank) ──► /pause_generation ──►
    /update_weights_from_distributed (one bucket each, while rank 0 broadcasts it) ... ──►
    /continue_generation ... ──► /destroy_weights_update_group

Every wait of a group ends after --weights-group-timeout-s: a trainer that never joins or
never sends makes the call fail, not hang.

    python -m areal.rollout.server --model DIR --port N [--host 127.0.0.1]
        [--max-batch-size 64] [--max-total-tokens 0] [--seed 0] [--num-threads 1]
        [--dtype float32] [--device auto] [--weight-version 0] [--api-key KEY]
        [--weights-root DIR ...] [--events-file F] [--keepalive-s 75]
        [--weights-group-timeout-s 120]

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
import time
from pathlib import Path

import torch
from aiohttp import web
from aiohttp.typedefs import Handler

from areal import events, rolelog
from areal.config import DTYPES
from areal.cores import role_cores
from areal.process import exit_now
from areal.rollout import sglang_api as api
from areal.rollout.activity import ServerActivity
from areal.rollout.auth import API_KEY_ENV, require_api_key, weights_path_problem
from areal.rollout.engine import DecodeEngine
from areal.rollout.http_error import BadRequest

logger = logging.getLogger(__name__)

STATE_KEY = web.AppKey("state", dict)
"""The app's state: the DecodeEngine (None until loaded), the tokenizer path, the weight
roots, the weight-update groups' timeout and the ServerActivity."""

# ---- handlers -----------------------------------------------------------------------------


def _state(request: web.Request) -> dict:
    return request.app[STATE_KEY]


def _decode_engine(request: web.Request) -> DecodeEngine:
    decode_engine = _state(request).get("decode_engine")
    if decode_engine is None:
        raise web.HTTPServiceUnavailable(text="the model is still loading")
    return decode_engine


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
    decode_engine = _decode_engine(request)
    specs, is_batch = api.parse_generate_body(await _json(request), decode_engine.tokenizer)
    futures = []
    try:
        for spec in specs:
            futures.append(
                asyncio.wrap_future(decode_engine.submit(spec.rid, spec.input_ids, spec.params))
            )
    except ValueError as e:
        for spec in specs[: len(futures)]:
            decode_engine.abort(rid=spec.rid)
        raise BadRequest(str(e)) from None
    except RuntimeError as e:  # shutting down
        raise web.HTTPServiceUnavailable(text=str(e)) from None
    pending = set(futures)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending and (request.transport is None or request.transport.is_closing()):
            # The client went away (SGLang does the same): free the batch slots.
            for spec in specs:
                decode_engine.abort(rid=spec.rid, message="The client disconnected.")
    outputs = [
        api.format_generate_output(f.result(), spec, decode_engine.tokenizer)
        for f, spec in zip(futures, specs, strict=True)
    ]
    return web.json_response(outputs if is_batch else outputs[0])


async def pause_generation(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    mode = api.parse_pause_body(await _json(request))
    _state(request)["activity"].paused()
    await asyncio.to_thread(decode_engine.pause, mode)
    return web.json_response(api.format_pause_response())


async def continue_generation(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    await _json(request)
    await asyncio.to_thread(decode_engine.continue_generation)
    _state(request)["activity"].continued()
    return web.json_response(api.format_continue_response())


async def update_weights_from_disk(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    model_path, version, abort_all = api.parse_update_weights_body(await _json(request))
    problem = weights_path_problem(model_path, _state(request)["weight_roots"])
    if problem:
        logger.warning("refused to load weights: %s", problem)
        body, status = api.format_update_weights_response(False, problem, 0)
        return web.json_response(body, status=status)
    with _state(request)["activity"].loading(version, interrupting=abort_all):
        result = await asyncio.to_thread(
            decode_engine.update_weights, model_path, version, abort_all
        )
    body, status = api.format_update_weights_response(*result)
    return web.json_response(body, status=status)


async def init_weights_update_group(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    spec = api.parse_init_weights_group_body(await _json(request))
    result = await asyncio.to_thread(
        decode_engine.init_weights_update_group,
        spec.master_address,
        spec.master_port,
        spec.rank_offset,
        spec.world_size,
        spec.group_name,
        spec.backend,
        _state(request)["weights_group_timeout_s"],
    )
    body, status = api.format_success_response(*result)
    return web.json_response(body, status=status)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    spec = api.parse_update_weights_from_distributed_body(await _json(request))
    with _state(request)["activity"].loading(spec.weight_version, spec.abort_all_requests):
        result = await asyncio.to_thread(
            decode_engine.update_weights_from_distributed,
            spec.names,
            spec.dtypes,
            spec.shapes,
            spec.group_name,
            spec.weight_version,
            spec.abort_all_requests,
            spec.load_format,
            spec.lora_config,
        )
    if not result[0]:
        logger.warning("refused a weight bucket: %s", result[1])
    body, status = api.format_success_response(*result)
    return web.json_response(body, status=status)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    group_name = api.parse_destroy_weights_group_body(await _json(request))
    result = await asyncio.to_thread(decode_engine.destroy_weights_update_group, group_name)
    body, status = api.format_success_response(*result)
    return web.json_response(body, status=status)


async def abort_request(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    rid, abort_all = api.parse_abort_body(await _json(request))
    if abort_all or rid:
        decode_engine.abort(rid=rid, abort_all=abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    _decode_engine(request)
    return web.Response(text=api.FLUSH_CACHE_TEXT)  # there is no prefix cache to flush


async def health(request: web.Request) -> web.Response:
    decode_engine = _state(request).get("decode_engine")
    return web.Response(
        status=200 if decode_engine is not None and decode_engine.is_alive() else 503
    )


async def model_info(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    tokenizer_path = _state(request)["tokenizer_path"]
    return web.json_response(
        api.format_model_info(
            decode_engine.model_path, tokenizer_path, decode_engine.weight_version
        )
    )


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response(
        api.format_weight_version_response(_decode_engine(request).weight_version)
    )


async def server_info(request: web.Request) -> web.Response:
    decode_engine = _decode_engine(request)
    info = api.format_server_info(
        model_path=decode_engine.model_path,
        tokenizer_path=_state(request)["tokenizer_path"],
        context_length=decode_engine.context_len,
        max_running_requests=decode_engine.max_batch_size,
        stats=decode_engine.stats(),
    )
    return web.json_response(info)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client mistakes become 400 with SGLang's error body, never a 500 with a traceback."""
    try:
        return await handler(request)
    except BadRequest as e:
        body, status = api.format_error(e)
        return web.json_response(body, status=status)
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": {"message": f"internal error: {e}"}}, status=500)


def create_app(
    tokenizer_path: str,
    api_key: str | None = None,
    weight_roots: list[str] | None = None,
    weights_group_timeout_s: float = 120.0,
) -> web.Application:
    """The application; put the DecodeEngine at app[STATE_KEY]["decode_engine"] once loaded."""
    middlewares = [require_api_key(api_key), _errors] if api_key else [_errors]
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    state: dict = {
        "decode_engine": None, "tokenizer_path": tokenizer_path, "weight_roots": weight_roots or [],
        "weights_group_timeout_s": weights_group_timeout_s,
    }  # fmt: skip
    state["activity"] = ServerActivity(
        lambda: getattr(state["decode_engine"], "weight_version", None)
    )
    app[STATE_KEY] = state
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
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


# ---- entry point --------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> int:
    app = create_app(args.model, args.api_key, args.weights_root, args.weights_group_timeout_s)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=args.keepalive_s)
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
        decode_engine = await asyncio.to_thread(
            DecodeEngine.from_dir,
            args.model,
            max_batch_size=args.max_batch_size,
            max_total_tokens=args.max_total_tokens,
            seed=args.seed,
            num_threads=role_cores(args.num_threads, borrows=False),  # lends only: cores.py
            weight_version=args.weight_version,
            dtype=getattr(torch, args.dtype),
            device=args.device,
        )
    except (OSError, ValueError) as e:
        print(f"cannot load the model from {args.model}: {e}", file=sys.stderr)
        await runner.cleanup()
        return 1
    decode_engine.start()
    app[STATE_KEY]["decode_engine"] = decode_engine
    rolelog.set_context(version=lambda: decode_engine.weight_version)
    print(
        f"areal embedded server ready at http://{args.host}:{args.port} on {args.device}",
        flush=True,
    )
    await stop.wait()
    st = decode_engine.stats()
    logger.info(
        "shutting down: %d requests finished (%d aborted), %d tokens generated and %d "
        "prefilled in %d decode steps; %.1f CPU-seconds",
        st["total_finished_reqs"], st["total_aborted_reqs"], st["total_generated_tokens"],
        st["total_prefilled_tokens"], st["num_decode_steps"], time.process_time(),
    )  # fmt: skip
    decode_engine.shutdown()  # resolves every waiting handler with an abort before the site closes
    await runner.cleanup()
    return 0


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{name!r} is not a device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: no CUDA device is visible to this process")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name!r}: the embedded server runs on cpu or cuda")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-threads", type=int, default=1,
        help="torch threads; 0: this process's share of the node's cores (AREAL_CPU_SHARE), "
        "lent while idle and borrowed while busy through AREAL_CPU_LEDGER when set",
    )  # fmt: skip
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=0,
        help="KV-cache budget in tokens (rows x longest request); 0: a quarter of free memory",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="the model's dtype while generating (model.dtype, as SGLang's flag); weights "
        "loaded later are cast to it",
    )  # fmt: skip
    parser.add_argument(
        "--device", type=_device, default="auto",
        help="cpu, cuda or cuda:N; auto: cuda when a GPU is visible (CUDA_VISIBLE_DEVICES "
        "names the server's own, as the launchers set it), else cpu",
    )  # fmt: skip
    parser.add_argument(
        "--weight-version", type=api.parse_weight_version, default=0,
        help="the version of --model's weights (an integer; SGLang's \"default\" is 0)",
    )  # fmt: skip
    parser.add_argument(
        "--events-file", help="record generate/pause/load spans here (areal/events.py)"
    )
    parser.add_argument(
        "--keepalive-s", type=float, default=75.0,
        help="seconds an idle HTTP connection is kept open (aiohttp's default, 75)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV}; none = open)",
    )  # fmt: skip
    parser.add_argument(
        "--weights-root", action="append", default=[],
        help="load weights only from under this directory (repeatable; none = anywhere)",
    )  # fmt: skip
    parser.add_argument(
        "--weights-group-timeout-s", type=float, default=120.0,
        help="seconds a weight-update group waits for its peers (joining, each broadcast) "
        "before the call fails",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.weights_group_timeout_s <= 0:
        parser.error("--weights-group-timeout-s must be > 0")
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
    exit_now(main())
