"""The megatron backend's GPU path: NCCL, bf16 parameters with fp32 gradients and Adam
states, packed THD sequences (with TransformerEngine), and a PP=2 pipeline schedule.

Skipped without CUDA (and PP=2 without two GPUs). Each case runs in spawned processes:
megatron's parallel state is per process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.trainer.optimizer import OptimizerSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEQS = [[5, 9, 14, 3, 22, 7, 1, 8], [40, 2, 2, 6], [11, 12, 13, 14, 15], [30, 31, 32]]
OPT = OptimizerSpec(
    lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0, warmup_steps=0
)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ["LOCAL_RANK"] = str(rank)


def _backend(model_dir: str, **kw):
    from areal.trainer.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, optimizer=OPT, dtype="bfloat16", **kw)


def _single_main(rank: int, model_dir: str, out_dir: str, port: int) -> None:
    import torch.distributed as dist

    from areal.trainer.megatron.model import has_transformer_engine
    from areal.trainer.parallel import DataParallel

    _join(rank, 1, port)
    os.environ["WORLD_SIZE"] = "1"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    out = Path(out_dir)
    b = _backend(model_dir)
    params = list(b.gpt.parameters())
    info = {
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "grad_dtypes": sorted({str(p.main_grad.dtype) for p in params}),
        "thd": b.packed_thd,
        "te": has_transformer_engine(),
        "backend": dist.get_backend(),
    }
    packed = b.logprobs(SEQS).detach().float()
    alone = torch.cat([b.logprobs([s]).detach().float() for s in SEQS])
    b.save_hf(out / "saved")
    before = [p.detach().clone() for p in params]
    lp = b.logprobs(SEQS)
    (-lp.float().mean()).backward()
    b.reduce_grads(DataParallel())
    info["grad_norm"] = b.optimizer_step()
    info["changed"] = sum(
        not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True)
    )
    info["n_params"] = len(params)
    opt_state = b.optimizer.state_dict()
    info["has_opt_state"] = bool(opt_state)
    # The checkpoint's optimizer file: Megatron's DP-sharded state, gathered and reloaded.
    b.save_optimizer(out)
    b.load_optimizer(out)
    info["optimizer_files"] = sorted(p.name for p in out.glob("optimizer-*"))
    save_file({"packed": packed.cpu(), "alone": alone.cpu()}, out / "lp.safetensors")
    (out / "info.json").write_text(json.dumps(info))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def test_bf16_params_fp32_grads_packed_sequences_and_bf16_weights_out(model_dir, tmp_path):
    mp.spawn(_single_main, args=(str(model_dir), str(tmp_path), free_port()), nprocs=1)
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["backend"] == "nccl"
    assert info["param_dtypes"] == ["torch.bfloat16"]
    assert info["grad_dtypes"] == ["torch.float32"]  # Megatron DDP's fp32 grad buffers
    assert info["thd"] == info["te"]  # packed THD sequences exactly when TE is there
    # (bf16 may round a small step of a norm weight away: not every tensor must move)
    assert info["grad_norm"] > 0 and info["changed"] > 0
    assert info["has_opt_state"]
    assert info["optimizer_files"] == ["optimizer-tp0-pp0.json", "optimizer-tp0-pp0.safetensors"]
    lp = load_file(tmp_path / "lp.safetensors")
    assert torch.allclose(lp["packed"], lp["alone"], atol=5e-2, rtol=0)  # bf16 kernels
    # bf16 out by default; the tiny model's fp32 weights rounded once to bf16.
    ref = load_file(model_dir / "model.safetensors")
    got = load_file(tmp_path / "saved/model.safetensors")
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].bfloat16()), k


def _pp_main(rank: int, model_dir: str, out_dir: str, port: int) -> None:
    from areal.trainer.megatron.backend import data_parallel_group
    from areal.trainer.parallel import init_data_parallel

    _join(rank, 2, port)
    world = init_data_parallel(1, rank, timeout_s=300, model_parallel=2)
    try:
        b = _backend(model_dir, pp=2)
        mbs = [SEQS[:2], SEQS[2:]]
        with torch.no_grad():
            fwd = b.forward(mbs)  # log-prob streams on every stage
        b.save_hf(Path(out_dir) / "saved_pp2" if rank == 0 else None)
        stats = b.forward_backward(mbs, lambda k, lp: (-lp.float().mean(), {"k": float(k)}))
        dp = data_parallel_group(world)
        b.reduce_grads(dp)
        norm = b.optimizer_step()
        info = {"fwd": [float(x.sum()) for x in fwd], "stats": stats, "norm": norm}
        (Path(out_dir) / f"pp_rank{rank}.json").write_text(json.dumps(info))
    finally:
        world.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PP=2 needs two GPUs")
def test_pipeline_parallel_two_stages(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    mp.spawn(_pp_main, args=(str(model_dir), str(tmp_path), free_port()), nprocs=2)
    info = json.loads((tmp_path / "pp_rank0.json").read_text())  # stage 0 got the results
    assert info["stats"] == [{"k": 0.0}, {"k": 1.0}] and info["norm"] > 0
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for k, mb in enumerate([SEQS[:2], SEQS[2:]]):
        ref = 0.0
        for s in mb:
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([s]).cuda()).logits[0, :-1].float()
            ref += (
                torch.log_softmax(logits, -1).gather(1, torch.tensor(s[1:]).cuda()[:, None]).sum()
            )
        assert info["fwd"][k] == pytest.approx(float(ref), rel=2e-2, abs=0.5)
    ref = load_file(model_dir / "model.safetensors")
    got = load_file(tmp_path / "saved_pp2/model.safetensors")
    assert all(torch.equal(got[k], ref[k].bfloat16()) for k in ref)
