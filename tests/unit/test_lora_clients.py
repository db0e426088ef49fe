"""LoRA versions through the clients that serve adapters by name (VLLMClient; SGLang's,
SGLangServerClient), against a fake server that enforces what the real ones do: a request
names its adapter when it arrives (even while paused), an unregistered name is refused (vLLM:
404, upstream AReaL's LoRA-update failures), and a request held by the pause runs on the
adapter it named. Request and answer shapes are the recorded vLLM ones
(tests/data/vllm_shapes.json) and SGLang's documented ones (tests/data/sglang_shapes.json)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from aiohttp import web

from areal.comm.net import free_port
from areal.rollout.client import SGLangClient, SGLangServerClient, adapter_name
from areal.rollout.vllm_client import VLLMClient

DATA = Path(__file__).parents[1] / "data"
VLLM = json.loads((DATA / "vllm_shapes.json").read_text())
SGLANG = json.loads((DATA / "sglang_shapes.json").read_text())


def _vllm_answer(kind: str, version: int, adapter: str | None) -> dict:
    body = copy.deepcopy(VLLM["generate_length"]["response"]["body"])
    choice = body["choices"][0]
    choice["finish_reason"] = kind
    n = len(choice["token_ids"])
    choice["weight_versions"] = [{"version": str(version), "start": 0, "end": n}]
    body["model"] = adapter or "base"
    return body


def _sglang_answer(kind: str, version: int, rid: str) -> dict:
    reason = {"stop": {"type": "stop", "matched": 2}, "abort": {"type": "abort", "message": "x"}}
    return {
        "text": "", "output_ids": [5, 2],
        "meta_info": {"id": rid, "finish_reason": reason[kind], "prompt_tokens": 2,
                      "completion_tokens": 2, "cached_tokens": 0, "weight_version": str(version),
                      "output_token_logprobs": [[-0.5, 5, None], [-0.7, 2, None]]},
    }  # fmt: skip


class FakeLoRAServer:
    """Registered adapter names, a pause that holds arriving requests, aborts; each request
    that runs records (its adapter, the version it is labelled with)."""

    def __init__(self, dialect: str, delay_pause: float = 0.0):
        self.dialect = dialect
        self.delay_pause = delay_pause
        self.names: dict[str, str] = {}
        self.adapter_of_version: dict[int, str] = {}
        self.version = 0
        self.paused = False
        self.calls: list[str] = []
        self.ran: list[tuple[str | None, int]] = []
        self.refused: list[str] = []
        self.waiting: list[asyncio.Future] = []  # each generate until released or aborted
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        path = request.path
        if path not in ("/inference/v1/generate", "/generate"):
            self.calls.append(path + ("" if body is None else " " + json.dumps(body)))
        if path in ("/pause", "/pause_generation"):
            self.paused = True
            if (request.query.get("mode") or body["mode"]) == "abort":
                self._abort_all()
            await asyncio.sleep(self.delay_pause)  # requests may arrive meanwhile
            return web.json_response({"status": "paused"} if path == "/pause" else {})
        if path in ("/resume", "/continue_generation"):
            self.paused = False
            return web.json_response({})
        if path in ("/abort_requests", "/abort_request"):
            self._abort_all()
            return web.json_response({})
        if path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
            self.names[body["lora_name"]] = body["lora_path"]
            if path == "/v1/load_lora_adapter":  # vLLM answers plain text
                return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added")
            answer = {"rid": None, "http_worker_ipc": None, "success": True,
                      "error_message": "", "loaded_adapters": dict(self.names)}  # fmt: skip
            return web.json_response(answer)
        if path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
            self.names.pop(body["lora_name"], None)
            return web.Response(text="Success") if path.startswith("/v1") else web.json_response(
                {"success": True, "error_message": ""})  # fmt: skip
        if path == "/update_weights_from_disk":
            self.version = int(body["weight_version"])
            return web.json_response({"success": True, "message": "", "num_paused_requests": 0})
        if path == "/update_weight_version":
            self.version = int(body["new_version"])
            return web.json_response({})
        if path in ("/inference/v1/generate", "/generate"):
            return await self._generate(body)
        return web.json_response({})

    def _abort_all(self) -> None:
        for fut in self.waiting:
            if not fut.done():
                fut.set_result("abort")

    async def _generate(self, body: dict) -> web.Response:
        rid = body.get("request_id") or body.get("rid")
        if "race" in json.dumps(rid):
            await asyncio.sleep(0.05)  # sent before the update began; arrives during its pause
        named = body.get("model") if self.dialect == "vllm" else body.get("lora_path")
        named = named[0] if isinstance(named, list) else named
        if named is not None and named not in self.names:  # resolved on arrival
            self.refused.append(named)
            if self.dialect == "vllm":
                return web.json_response(VLLM_404(named), status=404)
            return web.json_response({"error": {"message": f"unknown {named}"}}, status=400)
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        while self.paused and not fut.done():
            await asyncio.sleep(0.005)
        if not fut.done():
            release = asyncio.ensure_future(self.release.wait())
            await asyncio.wait([fut, release], return_when=asyncio.FIRST_COMPLETED)
            release.cancel()
        kind = fut.result() if fut.done() else "stop"
        if kind != "abort":
            self.ran.append((named, self.version))
        if self.dialect == "vllm":
            return web.json_response(_vllm_answer("length" if kind == "stop" else kind,
                                                  self.version, named))  # fmt: skip
        rids = body.get("rid")
        if isinstance(rids, list):
            return web.json_response([_sglang_answer(kind, self.version, r) for r in rids])
        return web.json_response(_sglang_answer(kind, self.version, rids or "r"))


def VLLM_404(name: str) -> dict:
    return {"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError",
                      "param": "model", "code": 404}}  # fmt: skip


def _adapter(tmp_path: Path, v: int) -> str:
    d = tmp_path / f"v{v}"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    return str(d)


def _run(fake: FakeLoRAServer, client_cls, body):
    async def main():
        runner = web.AppRunner(fake.app())
        await runner.setup()
        port = free_port("127.0.0.1")
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = client_cls(f"http://127.0.0.1:{port}", timeout=30)
        try:
            return await asyncio.wait_for(body(client), 30)
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main())


CLIENTS = [("vllm", VLLMClient), ("sglang", SGLangServerClient)]
PARAMS = {"max_new_tokens": 2}


@pytest.mark.parametrize(("dialect", "client_cls"), CLIENTS)
def test_each_version_is_registered_before_use_and_the_old_one_unloaded_after(
    tmp_path, dialect, client_cls
):
    fake = FakeLoRAServer(dialect)

    async def body(client):
        fake.release.set()  # requests finish at once
        await client.generate_batch([[1, 2]], [PARAMS], ["a"])  # the base model
        for v in (1, 2, 3):
            await client.update_weights_from_disk(_adapter(tmp_path, v), v, True)
            await client.generate_batch([[1, 2], [3]], [PARAMS, PARAMS], [f"b{v}", f"c{v}"])

    _run(fake, client_cls, body)
    assert fake.refused == []
    assert fake.names == {adapter_name(3): str(tmp_path / "v3")}  # older ones unloaded
    per_batch = 2 if dialect == "vllm" else 1  # vLLM: one request per prompt
    assert fake.ran == [(None, 0)] + [
        (adapter_name(v), v) for v in (1, 2, 3) for _ in range(per_batch)
    ]
    loads = [c for c in fake.calls if "load_lora_adapter" in c and "unload" not in c]
    assert len(loads) == 3
    want = {"lora_name": adapter_name(1), "lora_path": str(tmp_path / "v1")}
    if dialect == "vllm":
        want["load_inplace"] = True
    assert json.loads(loads[0].split(" ", 1)[1]) == want
    if dialect == "sglang":  # the request shapes of SGLang's documented API
        assert set(want) == set(SGLANG["load_lora_adapter_request"])
        version_call = next(c for c in fake.calls if c.startswith("/update_weight_version"))
        assert json.loads(version_call.split(" ", 1)[1]) == {
            "new_version": "1", "abort_all_requests": False}  # fmt: skip
    # The order of one update: pause, load, label, resume, then unload the previous name.
    pause, resume = ("/pause", "/resume") if dialect == "vllm" else (
        "/pause_generation", "/continue_generation")  # fmt: skip
    paths = [c.split(" ")[0] for c in fake.calls]
    tail = paths[len(paths) - 1 - paths[::-1].index(pause) :]
    assert tail[0] == pause and tail[-2] == resume and tail[-1].endswith("unload_lora_adapter")
    assert tail.index(resume) > tail.index("/update_weight_version")


@pytest.mark.parametrize(("dialect", "client_cls"), CLIENTS)
def test_requests_in_flight_and_racing_the_update_end_on_the_new_adapter(
    tmp_path, dialect, client_cls
):
    """An update aborts the running request and one that reaches the server during its
    pause naming the old adapter (without the client's drain that one would run on the old
    adapter under the new version's tag); a request made during the update waits and names
    the new one. Nothing ever names an unregistered adapter."""
    fake = FakeLoRAServer(dialect, delay_pause=0.1)

    async def body(client):
        fake.release.set()
        await client.update_weights_from_disk(_adapter(tmp_path, 1), 1, True)
        fake.release.clear()  # from here requests run until aborted or released
        running = asyncio.create_task(client.generate_batch([[1]], [PARAMS], ["run"]))
        await asyncio.sleep(0.05)
        racing = asyncio.create_task(client.generate_batch([[2]], [PARAMS], ["race"]))
        await asyncio.sleep(0)  # it has passed the gate and is on its way
        update = asyncio.create_task(
            client.update_weights_from_disk(_adapter(tmp_path, 2), 2, True)
        )
        await asyncio.sleep(0.01)
        late = asyncio.create_task(client.generate_batch([[3]], [PARAMS], ["late"]))
        outs = [(await running)[0], (await racing)[0]]
        await update
        fake.release.set()
        outs.append((await late)[0])
        outs.append((await client.generate_batch([[2]], [PARAMS], ["race"]))[0])  # resumed
        return outs

    running, racing, late, resumed = _run(fake, client_cls, body)
    assert fake.refused == []
    assert running.finish_reason == racing.finish_reason == "abort"
    assert late.weight_version == resumed.weight_version == 2
    assert late.finish_reason != "abort" and resumed.finish_reason != "abort"
    assert all(name == adapter_name(v) for name, v in fake.ran), fake.ran
    assert len(fake.ran) == 2


def test_the_embedded_server_gets_adapter_versions_through_update_weights(tmp_path):
    """The embedded server merges an adapter at /update_weights_from_disk: SGLangClient (its
    client) sends the directory there and names no adapter in its requests."""
    fake = FakeLoRAServer("sglang")

    async def body(client):
        fake.release.set()
        await client.update_weights_from_disk(_adapter(tmp_path, 1), 1, True)
        await client.generate_batch([[1]], [PARAMS], ["a"])

    _run(fake, SGLangClient, body)
    assert fake.ran == [(None, 1)]
    assert fake.calls[0].startswith("/update_weights_from_disk")
    assert not any("lora" in c for c in fake.calls)


def test_lora_servers_are_started_for_runtime_adapters(tmp_path, monkeypatch):
    """model.lora: vLLM gets --enable-lora with a rank it accepts and runtime updating in its
    environment; SGLang --enable-lora for every linear; a resumed run's servers start from the
    base (the rollout worker loads the checkpoint's adapter: start_adapter)."""
    import shlex

    from areal.checkpoint import save as save_checkpoint
    from areal.config import load_config
    from areal.rollout.backends import load_backend, start_adapter, start_weights

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    common = [f"model.path={model}", f"fileroot={tmp_path}", "model.lora.rank=12"]
    cfg = load_config(None, ["inference.backend=vllm", *common])
    argv, env = load_backend("vllm").command(cfg, 0, "h", 1, None)
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in shlex.join(argv)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = load_config(None, ["inference.backend=vllm", f"model.path={model}"])
    argv, env = load_backend("vllm").command(plain, 0, "h", 1, None)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    cfg = load_config(None, ["inference.backend=sglang", *common])
    text = shlex.join(load_backend("sglang").command(cfg, 0, "h", 1, None)[0])
    assert "--enable-lora --max-lora-rank 12 --lora-target-modules all" in text

    assert start_adapter(cfg) is None  # not resumed
    save_checkpoint(cfg.exp_dir, 7, lambda d: (d / "model").mkdir())
    resumed = load_config(None, ["inference.backend=sglang", *common, "resume=true"])
    assert start_weights(resumed) == (str(model), 0)
    assert start_adapter(resumed) == (7, str(cfg.exp_dir / "checkpoints/v000007/model"))
