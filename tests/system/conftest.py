"""Shared by the system tests: an embedded inference server as a real subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from areal.rollout.launch import start_embedded_server

READY = "areal embedded server ready at {url}"


@contextlib.contextmanager
def embedded_server(model_dir: Path, log_path: Path, *extra: str, api_key: str | None = None):
    """Yields the URL of a ready server; on exit, asserts it stopped cleanly on SIGTERM."""
    proc, url = start_embedded_server(
        model_dir, log_path, "--weight-version", "0", "--seed", "1", *extra, api_key=api_key
    )
    try:
        deadline = time.monotonic() + 90
        while READY.format(url=url) not in log_path.read_text():
            assert proc.poll() is None, f"server died:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not ready:\n{log_path.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            returncode = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # Clean shutdown on SIGTERM is part of the contract.
    assert returncode == 0, log_path.read_text()[-3000:]


def join_world(rank: int, world_size: int, port: int) -> None:
    """What a launcher sets for trainer rank `rank` of a world on loopback (in a spawned
    process), with one torch thread so that ranks share the cores fairly."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)


def copy_weights(src: Path, dst: Path, edit) -> Path:
    """A copy of the model directory src at dst, its tensors changed in place by edit."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@torch.no_grad()
def ref_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one plain forward pass."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs[torch.arange(len(output)), torch.tensor(output)]
