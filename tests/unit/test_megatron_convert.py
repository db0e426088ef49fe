"""HF <-> Megatron weight conversion as pure state-dict functions (no process groups):
bit-exact round trips for every TP/PP layout, sharded writes, and bad model directories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from areal.config import ConfigError, load_config
from areal.launcher.plan import make_plan, plan_sections
from areal.trainer.megatron.convert import (
    HFReader,
    HFWriter,
    convert_state,
    hf_shapes,
    merge_state,
    stage_names,
)
from areal.trainer.megatron.model import Qwen2Shape, check_layout, read_hf_config


def shape(tied: bool, vocab: int = 101) -> Qwen2Shape:
    # An odd vocab: TP=2 pads it, and the padding must vanish on the way back.
    return Qwen2Shape(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def random_hf(s: Qwen2Shape, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(v, generator=g).to(dtype) for k, v in hf_shapes(s).items()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tied, tp, pp, dtype):
    s = shape(tied)
    hf = random_hf(s, dtype)
    shards = convert_state(hf, s, tp, pp)
    assert len(shards) == tp * pp
    back = dict(merge_state(shards, s, tp, pp))
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_megatron_layout_of_one_rank():
    """The fused layouts Megatron's modules expect: per KV group q heads then k then v;
    fc1 = this rank's gate rows then its up rows; vocab padded and split."""
    s = shape(tied=False)
    hf = random_hf(s)
    shards = convert_state(hf, s, tp=2, pp=2)
    d, hpg = s.head_dim, s.num_heads // s.num_kv_heads
    # Stage 1, TP rank 1 holds global layer 2 (local 0) and KV group 1.
    qkv = shards[1, 1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    q = hf["model.layers.2.self_attn.q_proj.weight"]
    k = hf["model.layers.2.self_attn.k_proj.weight"]
    assert qkv.shape == ((hpg + 2) * d, s.hidden_size)
    assert torch.equal(qkv[: hpg * d], q[hpg * d : 2 * hpg * d])
    assert torch.equal(qkv[hpg * d : (hpg + 1) * d], k[d : 2 * d])
    fc1 = shards[1, 1]["decoder.layers.0.mlp.linear_fc1.weight"]
    half = s.intermediate_size // 2
    assert torch.equal(fc1[:half], hf["model.layers.2.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], hf["model.layers.2.mlp.up_proj.weight"][half:])
    out = shards[1, 1]["output_layer.weight"]  # 101 rows padded to 102: the last is zeros
    assert out.shape == (51, s.hidden_size) and not out[-1].any()
    assert "embedding.word_embeddings.weight" not in shards[1, 0]
    assert stage_names(shape(tied=True), 1, 0)[-1] == "decoder.final_layernorm.weight"


def test_sharded_write_reads_back(tmp_path):
    s = shape(tied=True)
    hf = random_hf(s)
    writer = HFWriter(tmp_path, torch.bfloat16, max_shard_bytes=20_000)
    for k, v in hf.items():
        writer.add(k, v)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "config.json").write_text("{}")
    reader = HFReader(tmp_path, s)
    for k, v in hf.items():
        got = reader.get(k)
        assert got.dtype == torch.bfloat16 and torch.equal(got, v.to(torch.bfloat16)), k


def write_model(d, s: Qwen2Shape, tensors: dict[str, torch.Tensor], **cfg):
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "tie_word_embeddings": s.tie_word_embeddings,
        **cfg,
    }
    (d / "config.json").write_text(json.dumps(config))
    if tensors:
        save_file(tensors, d / "model.safetensors")
    return d


def test_bad_model_directories_name_the_file_or_tensor(tmp_path):
    s = shape(tied=True)
    hf = random_hf(s)
    with pytest.raises(ValueError, match="config.json not found"):
        read_hf_config(tmp_path / "nothing")
    d = write_model(
        tmp_path / "llama", s, hf, model_type="llama", architectures=["LlamaForCausalLM"]
    )
    with pytest.raises(ValueError, match="llama.*Qwen2ForCausalLM only"):
        read_hf_config(d)
    d = write_model(tmp_path / "nofiles", s, {})
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        HFReader(d, read_hf_config(d)[1])
    missing = {k: v for k, v in hf.items() if k != "model.layers.3.mlp.up_proj.weight"}
    d = write_model(tmp_path / "missing", s, missing)
    with pytest.raises(ValueError, match=r"tensor model.layers.3.mlp.up_proj.weight is missing"):
        HFReader(d, read_hf_config(d)[1])
    wrong = dict(hf, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(8, 32)})
    d = write_model(tmp_path / "shape", s, wrong)
    reader = HFReader(d, read_hf_config(d)[1])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.1.self_attn"):
        reader.get("model.layers.1.self_attn.k_proj.weight")
    d = tmp_path / "index"
    write_model(d, s, {})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(hf, "model-00001-of-00001.safetensors")})
    )
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors is named in the index"):
        HFReader(d, s)
    with pytest.raises(ValueError, match="tp=4 must divide the 4 attention heads and 2 key"):
        check_layout(s, tp=4, pp=1)
    with pytest.raises(ValueError, match="pp=3 must divide the 4 layers"):
        check_layout(s, tp=1, pp=3)


def test_parallel_config_and_plan():
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.parallel.tp=2"])
    assert cfg.trainer.parallel.world_size == 2
    plan = make_plan(["n0"], 0, **plan_sections(cfg))
    assert plan.world_size == 2
    assert {s.env["WORLD_SIZE"] for s in plan.steps if s.role == "trainer"} == {"2"}
    cfg = load_config(
        None, ["trainer.backend=megatron", "trainer.parallel.tp=2", "trainer.parallel.pp=2"]
    )
    assert make_plan(["n0", "n1"], 0, **plan_sections(cfg)).world_size == 4
    with pytest.raises(ConfigError, match="tp=2, pp=1 need trainer.backend=megatron"):
        load_config(None, ["trainer.parallel.tp=2"])
    with pytest.raises(ConfigError, match="trainer.parallel.pp must be > 0"):
        load_config(None, ["trainer.backend=megatron", "trainer.parallel.pp=0"])
    with pytest.raises(ConfigError, match="save_dtype must be one of"):
        load_config(None, ["trainer.save_dtype=int8"])
    # GPUs: 8 training GPUs hold replicas of tp=4 (dp = 2); tp=3 cannot tile them.
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.parallel.tp=4"])
    assert make_plan(["n0", "n1", "n2", "n3"], 8, **plan_sections(cfg)).world_size == 8
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.parallel.tp=3"])
    with pytest.raises(ConfigError, match="cannot hold replicas of trainer.parallel.tp"):
        make_plan(["n0", "n1", "n2", "n3"], 8, **plan_sections(cfg))
