"""A fake inference server for the data-plane harness: SGLang's HTTP API, no model.

    python benchmarks/fake_sglang.py --port N --mean-tokens 8000 --tokens-per-s 20000
        [--vocab 64] [--sigma 1.0] [--seed 0]

/generate answers each request with a long-tailed (log-normal, mean --mean-tokens, cut at
the request's max_new_tokens) number of random tokens after len/--tokens-per-s seconds, in
SGLang's response shapes (areal/rollout/sglang_api.py, the embedded server's). An abort
(/abort_request, or /update_weights_from_disk with abort_all_requests) ends a request early
with the tokens "generated" so far and finish_reason abort, as SGLang does; a weight update
bumps the weight version. /pause_generation, /continue_generation, /flush_cache, /health
and /model_info answer as SGLang does. The rollout worker cannot tell it from a server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

from aiohttp import web

from areal.rollout import sglang_api as api
from areal.rollout.generation import GenerationResult


class Fake:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.version = 0
        self.aborts: dict[str, asyncio.Event] = {}
        # Token ids and log-probs to slice from: random ids, no model.
        cap = 1 << 16
        self.ids = [self.rng.randrange(3, args.vocab) for _ in range(cap)]
        self.lps = [round(-self.rng.random() * 3, 3) for _ in range(cap)]
        self.mu = math.log(args.mean_tokens) - args.sigma**2 / 2

    def length(self, cap: int) -> int:
        return max(1, min(cap, int(self.rng.lognormvariate(self.mu, self.args.sigma))))

    async def one(self, spec: api.GenerateSpec) -> dict:
        t0 = time.monotonic()
        cap = spec.params.max_new_tokens
        n = self.length(cap)
        aborted = self.aborts[spec.rid] = asyncio.Event()
        try:
            await asyncio.wait_for(aborted.wait(), n / self.args.tokens_per_s)
            n = max(0, min(n, int((time.monotonic() - t0) * self.args.tokens_per_s)))
            reason = {"type": "abort", "message": "Abort before prefill"}
        except asyncio.TimeoutError:
            reason = {"type": "length", "length": n} if n == cap else {"type": "stop", "matched": 2}
        finally:
            self.aborts.pop(spec.rid, None)
        start = self.rng.randrange(0, len(self.ids) - n)
        result = GenerationResult(
            rid=spec.rid,
            prompt_ids=spec.input_ids,
            output_ids=self.ids[start : start + n],
            logprobs=self.lps[start : start + n],
            finish_reason=reason,
            weight_version=self.version,
            e2e_latency=time.monotonic() - t0,
        )
        return api.format_generate_output(result, spec, None)


def app(fake: Fake) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        specs, is_batch = api.parse_generate_body(await request.json())
        outs = await asyncio.gather(*(fake.one(s) for s in specs))
        return web.Response(text=json.dumps(outs if is_batch else outs[0]))

    async def update_weights(request: web.Request) -> web.Response:
        _, version, abort_all = api.parse_update_weights_body(await request.json())
        n = len(fake.aborts)
        if abort_all:
            for event in list(fake.aborts.values()):
                event.set()
        fake.version = version if version is not None else fake.version + 1
        return web.json_response(api.format_update_weights_response(True, "ok", n)[0])

    async def abort(request: web.Request) -> web.Response:
        rid, abort_all = api.parse_abort_body(await request.json())
        for r, event in list(fake.aborts.items()):
            if abort_all or r == rid:
                event.set()
        return web.Response(status=200)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response(api.format_pause_response())

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(api.format_model_info("fake", "fake", fake.version))

    a = web.Application(client_max_size=1 << 30)
    a.router.add_post("/generate", generate)
    a.router.add_post("/update_weights_from_disk", update_weights)
    a.router.add_post("/abort_request", abort)
    a.router.add_post("/pause_generation", ok)
    a.router.add_post("/continue_generation", ok)
    a.router.add_post("/flush_cache", ok)
    a.router.add_get("/health", health)
    a.router.add_get("/model_info", model_info)
    a.router.add_get("/get_model_info", model_info)
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mean-tokens", type=float, default=8000)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--tokens-per-s", type=float, default=20000, help="per request")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    web.run_app(app(Fake(args)), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
