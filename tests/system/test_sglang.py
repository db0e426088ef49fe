"""A real SGLang server started by our launcher code, driven by our client (GPU + SGLang only).

Skipped unless a CUDA GPU exists and $AREAL_SGLANG_PYTHON (default: this interpreter) imports
the supported SGLang (tests/conftest.py). The tiny model is made wider here (head_dim 64) so
that SGLang's attention kernels accept it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from areal.comm.net import free_port
from areal.config import load_config
from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.backends import load_backend
from areal.rollout.client import SGLangClient
from areal.rollout.launch import start_server_process, wait_for_server
from tests.system.conftest import copy_weights
from tests.system.test_embedded_server import SHAPES, assert_shape

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden=256, warmup_steps=0)


def test_generate_update_generate(model_dir, tmp_path):
    from transformers import AutoTokenizer

    python = os.environ.get("AREAL_SGLANG_PYTHON") or sys.executable
    cfg = load_config(
        None,
        [
            f"fileroot={tmp_path}",
            f"model.path={model_dir}",
            "model.dtype=bfloat16",
            "inference.backend=sglang",
            f"inference.python={python}",
            "inference.mem_fraction=0.3",
            "inference.max_batch_size=8",
            # Fast start for a tiny model: no CUDA graphs; triton attention takes any head_dim.
            "inference.extra_args=[--disable-cuda-graph, --attention-backend, triton]",
        ],
    )
    port = free_port("127.0.0.1")
    cmd = load_backend("sglang").command(cfg, 0, "127.0.0.1", port, None)[0]
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    log = tmp_path / "server0.log"
    proc = start_server_process(cmd, log)
    url = f"http://127.0.0.1:{port}"
    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), "What is 2 plus 3?")
    new_dir = copy_weights(
        model_dir,
        tmp_path / "v1",
        lambda t: t.update({"model.norm.weight": t["model.norm.weight"] * 3}),
    )
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    async def body():
        client = SGLangClient(url, timeout=600)
        try:
            await wait_for_server(client, 900, log, proc)
            assert (await client.model_info())["weight_version"] == "0"

            # The real response against the shapes the embedded server copies: every field
            # we rely on, of its type (SGLang may add fields of its own).
            payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/generate", json=payload) as resp:
                    assert resp.status == 200
                    raw = json.loads(await resp.read())
            assert_shape(raw, SHAPES["generate"], exact=False)

            before = await client.generate(prompt, greedy)
            assert len(before.output_ids) == len(before.logprobs) == 8
            assert all(lp <= 0 for lp in before.logprobs) and before.weight_version == 0

            result = await client.update_weights_from_disk(str(new_dir), 1)
            assert_shape(result, SHAPES["update_weights_from_disk"])
            assert (await client.model_info())["weight_version"] == "1"

            after = await client.generate(prompt, greedy)
            assert after.weight_version == 1 and len(after.logprobs) == 8
            # Three times the final norm sharpens the distribution: the log-probs change.
            assert after.logprobs != before.logprobs
        finally:
            await client.close()

    try:
        asyncio.run(body())
    finally:
        # The server's own session: its scheduler and detokenizer processes stop with it.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
