"""LoRA (areal/lora.py, model.lora): the layer is its formula, the trainer trains the adapters
alone, a version is the adapter (small), the embedded engine serving base + adapter computes
the trainer's log-probs, a checkpoint resumes exactly, and export writes the merged model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal.checkpoint import save as save_checkpoint
from areal.config import ConfigError, load_config
from areal.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoRALinear,
    LoRASpec,
    apply_lora,
    is_adapter_dir,
    lora_layers,
)
from areal.models.tiny import build_tokenizer, make_tiny_model, tiny_config
from areal.rollout.engine import DecodeEngine, SamplingParams
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import DataParallel
from areal.trainer.torch_backend import TorchBackend
from areal.trainer.worker import load_trainer_part, write_trainer_part
from tests.unit.test_engine_cache import _wait_tokens

SEQS = [[5, 9, 14, 3, 22, 7, 1], [40, 2, 2], [11, 12, 13, 14, 15], [30, 31]]
SPEC = LoRASpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


OPT = OptimizerSpec(
    lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999), adam_eps=1e-3, grad_clip=1.0, warmup_steps=4
)
PLAIN_OPT = OptimizerSpec(
    lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0, warmup_steps=1
)


def make_backend(model_dir, adapter_dir=None, spec=SPEC) -> TorchBackend:
    return TorchBackend.from_dir(
        model_dir, optimizer=OPT, device="cpu", lora=spec, adapter_dir=adapter_dir
    )


def _step(backend: TorchBackend, k: int) -> None:
    def loss_fn(i, logprobs):
        return -logprobs.mean() * (k + 1), {}

    backend.forward_backward([SEQS[:2], SEQS[2:]], loss_fn, [[3, 0], [1, 0]])
    backend.reduce_grads(DataParallel())
    backend.optimizer_step()


def test_the_layer_is_its_formula_and_merges_exactly():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 8)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), base(x))  # B = 0: the base model, exactly
    with torch.no_grad():
        layer.lora_B.normal_()
    want = base(x) + 2.0 * (x @ layer.lora_A.T @ layer.lora_B.T)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-6)
    merged = torch.nn.Linear(16, 8)
    merged.load_state_dict(base.state_dict())
    with torch.no_grad():
        merged.weight += layer.delta()
    torch.testing.assert_close(merged(x), layer(x), rtol=0, atol=1e-5)


def test_targets_are_chosen_by_name_and_a_miss_is_a_clear_error():
    model = AutoModelForCausalLM.from_config(tiny_config(build_tokenizer(0)))
    names = apply_lora(model, LoRASpec(rank=2, alpha=2.0, target_modules=("q_proj", "v_proj")))
    assert names and all(n.endswith(("q_proj", "v_proj")) for n in names)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"{n}.lora_{ab}" for n in names for ab in "AB"
    ]
    with pytest.raises(ValueError, match="matches no linear layer"):
        apply_lora(model, LoRASpec(rank=2, alpha=2.0, target_modules=("qkv",)))


def test_config_lora_section_and_megatron_refusal():
    assert not load_config().model.lora.enabled  # full fine-tuning by default
    cfg = load_config(None, ["model.lora.rank=16", "model.lora.target_modules=[q_proj]"])
    assert cfg.model.lora.enabled and cfg.model.lora.target_modules == ["q_proj"]
    with pytest.raises(ConfigError, match="model.lora needs trainer.backend=torch"):
        load_config(None, ["model.lora.rank=16", "trainer.backend=megatron"])
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        load_config(None, ["model.lora.rank=16", "model.lora.dropout=1.5"])


def test_the_trainer_trains_adapters_alone_and_a_version_is_the_adapter(model_dir, tmp_path):
    backend = make_backend(model_dir)
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_before = {k: v.clone() for k, v in full.state_dict().items()}
    n_adapter = sum(p.numel() for p in backend.trainable)
    assert backend.optimizer.param_groups[0]["params"] == backend.trainable
    assert n_adapter < sum(p.numel() for p in backend.model.parameters()) / 4
    lp0 = backend.forward([SEQS])[0]
    ref = TorchBackend.from_dir(model_dir, optimizer=PLAIN_OPT, device="cpu")
    torch.testing.assert_close(lp0, ref.forward([SEQS])[0], rtol=0, atol=1e-6)  # B = 0

    for k in range(3):
        _step(backend, k)
    for name, layer in lora_layers(backend.model).items():
        assert torch.equal(layer.base.weight, base_before[f"{name}.weight"]), name  # frozen
    assert all(len(s) == 3 for s in backend.optimizer.state.values())  # step, exp_avg(_sq)
    assert len(backend.optimizer.state) == len(backend.trainable)

    v1 = tmp_path / "v1"
    backend.save_hf(v1)
    assert is_adapter_dir(v1) and sorted(p.name for p in v1.iterdir()) == [
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
    ]
    config = json.loads((v1 / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and "q_proj" in config["target_modules"]
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert (v1 / ADAPTER_WEIGHTS).stat().st_size * 3 < model_bytes


def test_the_engine_serves_base_plus_adapter_with_the_trainers_logprobs(model_dir, tmp_path):
    """Merged into the engine's weights at load, from the base kept apart: each version's
    log-probs are the trainer's (float32, ~1e-6), and versions do not add up."""
    backend = make_backend(model_dir)
    engine = DecodeEngine.from_dir(str(model_dir))
    base_lp = None
    for v in (1, 2):
        _step(backend, v)
        backend.save_hf(tmp_path / f"v{v}")
        ok, message, _ = engine.update_weights(str(tmp_path / f"v{v}"), weight_version=v)
        assert ok, message
        assert engine.weight_version == v
        with torch.no_grad():
            logits = engine.model(torch.tensor([SEQS[0]])).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(
            1, torch.tensor(SEQS[0][1:])[:, None]
        )[:, 0]
        want = backend.forward([[SEQS[0]]])[0]
        assert (lp - want).abs().max() < 1e-5
        assert base_lp is None or (lp - base_lp).abs().max() > 1e-4  # v2 is not v1
        base_lp = lp
    # A whole model replaces the base (and what the adapters had merged).
    ok, message, _ = engine.update_weights(str(model_dir), weight_version=3)
    assert ok, message
    for name, t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    # A bad adapter changes nothing and says why.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ADAPTER_CONFIG).write_text("{}")
    ok, message, _ = engine.update_weights(str(bad))
    assert not ok and "adapter" in message


def test_an_adapter_update_interrupts_generation_which_resumes_on_the_adapter(model_dir, tmp_path):
    """The rollout worker's interruption with an adapter as the new version: the update
    aborts the running request with its partial output (the base's tokens), and the
    resubmitted prompt + partial output generates on base + adapter, as the trainer sees."""
    backend = make_backend(model_dir)
    _step(backend, 1)
    backend.save_hf(tmp_path / "v1")
    engine = DecodeEngine.from_dir(str(model_dir))
    params = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
    running = engine.submit("a", SEQS[0], params)
    _wait_tokens(engine, 10)
    ok, message, _ = engine.update_weights(str(tmp_path / "v1"), 1, abort_all_requests=True)
    assert ok, message
    part = running.result(timeout=30)
    assert part.finish_reason["type"] == "abort" and 0 < len(part.output_ids) < 400
    n = len(part.output_ids)
    rest = engine.submit("a2", SEQS[0] + part.output_ids, replace(params, max_new_tokens=20))
    rest = rest.result(timeout=30)
    assert rest.weight_version == 1 and len(rest.output_ids) == 20
    seq = SEQS[0] + part.output_ids + rest.output_ids
    want = backend.forward([[seq]])[0][len(SEQS[0]) - 1 :]
    base = make_backend(model_dir).forward([[seq]])[0][len(SEQS[0]) - 1 :]
    assert (torch.tensor(part.logprobs) - base[:n]).abs().max() < 1e-5  # before: the base
    assert (torch.tensor(rest.logprobs) - want[n:]).abs().max() < 1e-5  # after: the adapter
    assert (want[n:] - base[n:]).abs().max() > 1e-4  # which differ


def test_a_lora_checkpoint_resumes_exactly(model_dir, tmp_path):
    """2 steps, a checkpoint (adapter + its Adam state), 1 step from it = 3 straight steps."""
    straight = make_backend(model_dir)
    for k in (0, 1):
        _step(straight, k)
    ckpt = save_checkpoint(tmp_path, 2, lambda d: write_trainer_part(straight, d))
    assert is_adapter_dir(ckpt.model_dir)
    _step(straight, 2)

    resumed = make_backend(model_dir, adapter_dir=ckpt.model_dir)
    load_trainer_part(resumed, ckpt.path)
    _step(resumed, 2)
    for (name, p), r in zip(straight.model.named_parameters(), resumed.model.parameters(),
                            strict=True):  # fmt: skip
        assert torch.equal(p, r), name
    with pytest.raises(ValueError, match="model.lora.rank=4"):
        load_trainer_part(make_backend(model_dir, spec=LoRASpec(rank=2, alpha=2.0)), ckpt.path)


def test_a_bfloat16_lora_trainer_holds_the_base_in_bfloat16(model_dir):
    backend = TorchBackend.from_dir(
        model_dir, optimizer=PLAIN_OPT, device="cpu", dtype="bfloat16", lora=SPEC
    )
    frozen = [p for p in backend.model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in backend.trainable)
    before = [p.clone() for p in backend.trainable]
    _step(backend, 0)
    assert any(not torch.equal(a, b) for a, b in zip(before, backend.trainable, strict=True))


def test_export_writes_the_merged_model(model_dir, tmp_path):
    """python -m areal.export on a LoRA checkpoint: a plain HF model (tokenizer included)
    whose log-probs are the trainer's."""
    from areal.export import main

    backend = make_backend(model_dir)
    for k in (0, 1):
        _step(backend, k)
    exp = tmp_path / "exp"
    save_checkpoint(exp, 2, lambda d: write_trainer_part(backend, d))
    assert main([str(exp), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    with torch.no_grad():
        logits = merged(torch.tensor([SEQS[0]])).logits[0]
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(SEQS[0][1:])[:, None])[:, 0]
    assert (lp - backend.forward([[SEQS[0]]])[0]).abs().max() < 1e-5
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
