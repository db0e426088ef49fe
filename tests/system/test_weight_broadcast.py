"""Weights broadcast into a live embedded server over a weight-update group (gloo), as a
trainer sends them: this test process is rank 0, the server (a real subprocess) rank 1.

    trainer (here)                                  embedded server
    open_group(rank 0) ──── /init_weights_update_group (rank 1) ──── joined
    per bucket: send(group, tensors) ── /update_weights_from_distributed {spec(bucket)} ──
    received, checked, applied

One server serves the module and tests run in file order: the served weights change from test
to test (the last restores the original ones). Its --weights-group-timeout-s is short, so a
sender that never sends fails the call within it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.comm.net import free_port
from areal.lora import (
    LoRASpec,
    adapter_leaves,
    adapter_tensors,
    apply_lora,
    layer_of,
    lora_layers,
    save_adapter,
)
from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.client import SGLangClient
from areal.weight_group import Group, buckets, open_group, send, spec
from tests.system.conftest import copy_weights, embedded_server, ref_logprobs
from tests.system.test_embedded_server import SHAPES, assert_shape

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 4.0
"""The server's --weights-group-timeout-s (and the trainer's group timeout)."""
GROUP = "weight_update_group"
SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
LONG = {"max_new_tokens": 900, "temperature": 1.0, "ignore_eos": True}
"""Runs for seconds even on a GPU (the tiny model's context is 1024 tokens)."""


def edit(tensors: dict[str, torch.Tensor]) -> None:
    """The new version: every matrix moved a little, the final norm tripled (3.0 is exact in
    bfloat16, the dtype that tensor is sent in)."""
    gen = torch.Generator().manual_seed(7)
    for t in tensors.values():
        if t.dim() == 2:
            t.add_(0.02 * torch.randn(t.shape, generator=gen))
    tensors["model.norm.weight"].mul_(3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", warmup_steps=0)


@pytest.fixture(scope="module")
def new_dir(model_dir, tmp_path_factory) -> Path:
    return copy_weights(model_dir, tmp_path_factory.mktemp("v1") / "tiny", edit)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with embedded_server(model_dir, log, "--weights-group-timeout-s", str(TIMEOUT_S)) as url:
        yield url


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    return chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), "What is 2 plus 3?")


def load_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def named_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    """A version as a trainer sends it: the tied embedding under its other name, lm_head's,
    and the final norm in bfloat16 (the server casts it)."""
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    return sorted(tensors.items())


def run(body, url: str):
    async def main():
        client = SGLangClient(url, timeout=60)
        try:
            return await asyncio.wait_for(body(client), 60)
        finally:
            await client.close()

    return asyncio.run(main())


async def join(client: SGLangClient) -> Group:
    """Form the group: the server joins over HTTP while this process joins as rank 0."""
    port = free_port("127.0.0.1")
    joining = asyncio.create_task(
        client.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
    )
    await asyncio.sleep(0.3)
    # The server waits for rank 0 in a worker thread: it answers meanwhile.
    assert not joining.done() and await client.health()
    group = await asyncio.to_thread(
        open_group, backend="gloo", master_address="127.0.0.1", master_port=port, rank=0,
        world_size=2, group_name=GROUP, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    answer = await joining
    assert_shape(answer, SHAPES["init_weights_update_group"])
    assert answer["success"] is True
    return group


async def send_bucket(
    client: SGLangClient, group: Group, bucket: list, version: int, **kwargs
) -> dict:
    """One update request, its tensors broadcast meanwhile."""
    update = asyncio.create_task(
        client.update_weights_from_distributed(
            **spec(bucket), group_name=GROUP, weight_version=version, **kwargs
        )
    )
    await asyncio.to_thread(send, group, [t.contiguous() for _, t in bucket])
    return await update


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as resp:
            return resp.status, json.loads(await resp.read())


async def stats(client: SGLangClient) -> dict:
    return await client.server_info()


def assert_served_by(model: torch.nn.Module, prompt: list[int], out) -> None:
    expected = ref_logprobs(model, prompt, out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_a_version_sent_in_buckets_is_served(server, model_dir, new_dir, prompt):
    named = named_tensors(new_dir)
    total = sum(t.numel() * t.element_size() for _, t in named)
    parts = list(buckets(named, total // 3))
    assert len(parts) >= 3

    async def body(client: SGLangClient):
        group = await join(client)
        try:
            # A request running across the update: paused in place, resumed on version 1.
            kept = asyncio.create_task(client.generate(prompt, {**LONG, "max_new_tokens": 200}))
            while (await stats(client))["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            await client.pause_generation("in_place")
            for bucket in parts:
                answer = await send_bucket(client, group, bucket, 1)
                assert_shape(answer, SHAPES["update_weights_from_distributed"])
                assert answer["success"] and "Weight version updated to 1" in answer["message"]
            await client.continue_generation()
            resumed = await kept
            out = await client.generate(prompt, SAMPLING)
            answer = await client.destroy_weights_update_group(GROUP)
            assert_shape(answer, SHAPES["destroy_weights_update_group"])
            version = (await client.model_info())["weight_version"]
            return resumed, out, version
        finally:
            group.close()

    resumed, out, version = run(body, server)
    assert (resumed.finish_reason, resumed.weight_version) == ("length", 1)
    assert out.weight_version == 1 and version == "1"
    assert_served_by(load_model(new_dir), prompt, out)
    old = ref_logprobs(load_model(model_dir), prompt, out.output_ids, 1.0)
    assert (torch.tensor(out.logprobs) - old).abs().max() > 1e-2


def test_decoding_goes_on_while_a_bucket_is_received(server, new_dir, prompt):
    """The receive holds no engine lock; abort_all_requests then aborts what runs."""
    norm = [(n, t) for n, t in named_tensors(new_dir) if n == "model.norm.weight"]

    async def body(client: SGLangClient):
        group = await join(client)
        try:
            running = asyncio.create_task(client.generate(prompt, LONG))
            while (await stats(client))["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            update = asyncio.create_task(
                client.update_weights_from_distributed(
                    **spec(norm), group_name=GROUP, weight_version=2, abort_all_requests=True
                )
            )
            before = (await stats(client))["total_generated_tokens"]
            await asyncio.sleep(0.5)  # the server waits for the broadcast: tokens keep coming
            assert (await stats(client))["total_generated_tokens"] > before
            assert not update.done()
            await asyncio.to_thread(send, group, [norm[0][1]])
            assert (await update)["success"]
            aborted = await running
            await client.destroy_weights_update_group(GROUP)
            return aborted
        finally:
            group.close()

    aborted = run(body, server)
    assert (aborted.finish_reason, aborted.weight_version) == ("abort", 1)
    assert "update_weights_from_distributed" in aborted.message


def test_a_bad_bucket_is_refused_and_changes_nothing(server, new_dir, prompt):
    norm = dict(named_tensors(new_dir))["model.norm.weight"]
    bad_name = [("model.norm.weight", norm * 5), ("model.nope", torch.ones(3))]
    bad_shape = [("model.norm.weight", torch.ones(7)), ("model.layers.0.mlp.up_proj.weight",
                                                       torch.zeros(256, 64))]  # fmt: skip

    async def body(client: SGLangClient):
        group = await join(client)
        try:
            url = client.base_url + "/update_weights_from_distributed"
            posted = asyncio.create_task(post(url, {**spec(bad_name), "weight_version": "5"}))
            await asyncio.to_thread(send, group, [t for _, t in bad_name])
            status, answer = await posted
            assert status == 400 and answer["success"] is False
            assert_shape(answer, SHAPES["update_weights_from_distributed"])
            assert "unexpected tensor model.nope" in answer["message"]
            with pytest.raises(RuntimeError, match=r"model\.norm\.weight has shape \(7,\)"):
                await send_bucket(client, group, bad_shape, 5)
            # Refused before any broadcast: what cannot be received at all.
            one = spec([("model.norm.weight", norm)])
            for malformed, problem in [
                ({**one, "load_format": "flattened_bucket"}, "load_format 'flattened_bucket'"),
                ({**one, "dtypes": ["float7"]}, "unknown dtype 'float7'"),
                ({**one, "shapes": []}, "one entry per tensor"),
            ]:
                status, answer = await post(url, malformed)
                assert status == 400 and problem in json.dumps(answer), answer
            out = await client.generate(prompt, SAMPLING)
            # Every refused broadcast was received: the group is still in step.
            assert (await send_bucket(client, group, [("model.norm.weight", norm)], 3))["success"]
            await client.destroy_weights_update_group(GROUP)
            return out
        finally:
            group.close()

    out = run(body, server)
    assert out.weight_version == 2  # neither refused bucket changed the version
    assert_served_by(load_model(new_dir), prompt, out)  # nor the weights


def test_a_sender_that_dies_or_never_sends_fails_and_the_server_serves_on(
    server, model_dir, prompt
):
    named = named_tensors(model_dir)

    async def body(client: SGLangClient):
        # 1) The sender dies after the first tensor of a bucket (its connections close, as
        # when its process dies): the receive fails at once, not after the timeout.
        group = await join(client)
        update = asyncio.create_task(
            client.update_weights_from_distributed(**spec(named[:2]), group_name=GROUP,
                                                   weight_version=9)
        )  # fmt: skip
        await asyncio.to_thread(send, group, [named[0][1]])
        start = time.monotonic()
        group.close()
        group.pg = None  # the last reference: gloo closes the group's connections
        gc.collect()
        with pytest.raises(RuntimeError, match="Failed to receive weights over group"):
            await update
        assert time.monotonic() - start < TIMEOUT_S
        assert (await client.destroy_weights_update_group(GROUP))["success"]
        with pytest.raises(RuntimeError, match=f"no weight-update group named '{GROUP}'"):
            await client.destroy_weights_update_group(GROUP)

        # 2) The sender never sends: the call fails within the server's group timeout.
        group = await join(client)
        try:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="Failed to receive weights over group"):
                await client.update_weights_from_distributed(
                    **spec(named[:2]), group_name=GROUP, weight_version=9
                )
            waited = time.monotonic() - start
            assert await client.health()
            out = await client.generate(prompt, SAMPLING)
            await client.destroy_weights_update_group(GROUP)
        finally:
            group.close()

        # 3) A new group under the same name restores the original weights.
        group = await join(client)
        try:
            for bucket in buckets(named, 1 << 20):
                assert (await send_bucket(client, group, bucket, 4))["success"]
            restored = await client.generate(prompt, SAMPLING)
            await client.destroy_weights_update_group(GROUP)
        finally:
            group.close()
        return waited, out, restored

    waited, out, restored = run(body, server)
    assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 5
    assert out.weight_version == 3  # the failed updates changed nothing
    assert restored.weight_version == 4
    assert_served_by(load_model(model_dir), prompt, restored)


def test_an_adapter_over_the_group_is_served_as_from_disk(server, model_dir, prompt, tmp_path):
    """model.lora: the adapter's tensors (load_format "lora", lora_config) are merged into
    the served base; the same adapter from disk serves the same log-probs. Runs on the
    original weights (the test before restores them)."""
    model = load_model(model_dir)
    spec_ = LoRASpec(rank=4, alpha=8.0)
    apply_lora(model, spec_)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.05)
    save_adapter(model, tmp_path / "adapter", spec_)
    named = sorted(adapter_tensors(model).items())
    config = {"r": 4, "lora_alpha": 8.0, "target_modules": adapter_leaves(n for n, _ in named)}

    async def body(client: SGLangClient):
        group = await join(client)
        try:
            url = client.base_url + "/update_weights_from_distributed"
            # Refused before any broadcast: a LoRA bucket without its lora_config.
            status, answer = await post(url, {**spec(named[:2]), "load_format": "lora"})
            assert status == 400 and "lora_config" in json.dumps(answer), answer
            for bucket in buckets(named, 20_000, layer_of):
                answer = await send_bucket(
                    client, group, bucket, 5, load_format="lora", lora_config=config
                )
                assert answer["success"], answer
            by_group = await client.generate(prompt, SAMPLING)
            await client.destroy_weights_update_group(GROUP)
        finally:
            group.close()
        await client.update_weights_from_disk(str(tmp_path / "adapter"), 6)
        return by_group, await client.generate(prompt, SAMPLING)

    by_group, from_disk = run(body, server)
    assert by_group.weight_version == 5 and from_disk.weight_version == 6
    # Both served base + adapter (the unmerged formula's log-probs), not the base alone.
    assert_served_by(model.eval(), prompt, by_group)
    assert_served_by(model, prompt, from_disk)
    base = ref_logprobs(load_model(model_dir), prompt, by_group.output_ids, 1.0)
    assert (torch.tensor(by_group.logprobs) - base).abs().max() > 1e-3
