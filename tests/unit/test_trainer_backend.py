"""The trainer backend seam: both backends are backend.TrainerBackend, the torch backend's
optimizer state survives a checkpoint, and the worker's save rule."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from areal.checkpoint import save as save_checkpoint
from areal.models.tiny import make_tiny_model
from areal.trainer.backend import TrainerBackend
from areal.trainer.parallel import DataParallel
from areal.trainer.torch_backend import TorchBackend
from areal.trainer.worker import load_trainer_part, save_rule, write_trainer_part

SEQS = [[5, 9, 14, 3, 22, 7, 1], [40, 2, 2], [11, 12, 13, 14, 15], [30, 31]]


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(TrainerBackend).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


def _assert_implements(cls: type) -> None:
    """Every method of the Protocol, with its parameters (names and defaults), and the
    declared collective_save flag."""
    assert isinstance(getattr(cls, "collective_save", None), bool), cls
    methods = _protocol_methods()
    assert {"forward", "forward_backward", "save_optimizer", "load_optimizer"} <= set(methods)
    for name, want in methods.items():
        got = inspect.signature(getattr(cls, name))
        assert [(p.name, p.default) for p in got.parameters.values()] == [
            (p.name, p.default) for p in want.parameters.values()
        ], (cls.__name__, name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


def make_backend(model_dir) -> TorchBackend:
    return TorchBackend.from_dir(
        model_dir,
        lr=1e-2,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        adam_eps=1e-3,
        grad_clip=1.0,
        warmup_steps=4,  # the learning rate still ramps after the checkpoint
        device="cpu",
    )


def test_the_torch_backend_is_a_trainer_backend(model_dir):
    _assert_implements(TorchBackend)
    assert isinstance(make_backend(model_dir), TrainerBackend)
    assert TorchBackend.collective_save is False


def test_the_megatron_backend_is_a_trainer_backend():
    pytest.importorskip("megatron.core")
    from areal.trainer.megatron.backend import MegatronBackend

    _assert_implements(MegatronBackend)
    assert MegatronBackend.collective_save is True


def _step(backend: TorchBackend, k: int) -> None:
    def loss_fn(i, logprobs):
        return -logprobs.mean() * (k + 1), {}

    backend.forward_backward([SEQS[:2], SEQS[2:]], loss_fn, [[3, 0], [1, 0]])
    backend.reduce_grads(DataParallel())
    backend.optimizer_step()


def test_torch_optimizer_state_survives_a_checkpoint(model_dir, tmp_path):
    """2 steps, a checkpoint, 1 step from it = 3 uninterrupted steps, bit for bit; without
    the optimizer state the third step differs."""
    straight = make_backend(model_dir)
    for k in (0, 1):
        _step(straight, k)
    ckpt = save_checkpoint(tmp_path, 2, lambda d: write_trainer_part(straight, d))
    assert (ckpt.path / "optimizer-tp0-pp0.safetensors").exists()
    _step(straight, 2)

    resumed = make_backend(ckpt.model_dir)
    load_trainer_part(resumed, ckpt.path)
    assert resumed.n_steps == 2
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)
    _step(resumed, 2)
    fresh = make_backend(ckpt.model_dir)  # the same weights, no optimizer state
    _step(fresh, 2)

    for (name, p), r in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(p, r), name
    assert any(
        not torch.equal(p, f)
        for p, f in zip(straight.model.parameters(), fresh.model.parameters(), strict=True)
    )


def test_an_old_torch_checkpoint_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="model.path=<the checkpoint's model/ directory>"):
        make_backend(model_dir).load_state_dict({"optimizer": {}, "scheduler": {}})


def test_save_rule():
    cfg = SimpleNamespace(
        total_train_steps=10, trainer=SimpleNamespace(save_freq_steps=4, save_freq_s=60.0)
    )
    assert [v for v in range(1, 11) if save_rule(cfg, v, 0.0)] == [4, 8, 10]
    assert save_rule(cfg, 3, 60.0) and not save_rule(cfg, 3, 59.0)
    cfg.trainer.save_freq_s = 0.0  # off
    assert not save_rule(cfg, 3, 1e9)


def test_torch_logits_give_the_log_prob_stream(model_dir):
    """logits (checks against HF) and logprobs read the same packed forward."""
    backend = make_backend(model_dir)
    logits = backend.logits(SEQS)
    assert logits.shape == (sum(map(len, SEQS)), backend.model.config.vocab_size)
    lp = torch.log_softmax(logits.float(), -1)
    ref = torch.cat(
        [
            lp[k : k + len(s) - 1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            for k, s in zip([0, 7, 10, 15], SEQS, strict=True)
        ]
    )
    torch.testing.assert_close(backend.logprobs(SEQS).detach(), ref, atol=1e-5, rtol=0)


def test_a_bfloat16_trainer_keeps_float32_weights_and_adam(model_dir):
    """model.dtype=bfloat16: the forward runs in bfloat16 (log-probs within bfloat16's
    noise of float32's, not equal), the parameters and Adam's moments stay float32, and an
    update far below bfloat16's resolution is kept."""
    fp32 = make_backend(model_dir)
    bf16 = TorchBackend.from_dir(
        model_dir, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8,
        grad_clip=1.0, warmup_steps=0, dtype="bfloat16", device="cpu",
    )  # fmt: skip
    with torch.no_grad():
        want, got = fp32.logprobs(SEQS), bf16.logprobs(SEQS)
    assert got.dtype == torch.float32
    assert 0 < (got - want).abs().max() < 0.1
    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    _step(bf16, 0)
    for name, p in bf16.model.named_parameters():
        assert p.dtype == torch.float32, name
        assert all(v.dtype == torch.float32 for v in bf16.optimizer.state[p].values()), name
    moved = [n for n, p in bf16.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved, "an update of lr 1e-6 was lost"
    # A bfloat16 parameter of these magnitudes could not hold any of these changes.
    lost = [
        n for n in moved
        if torch.equal(before[n].bfloat16(), dict(bf16.model.named_parameters())[n].bfloat16())
    ]  # fmt: skip
    assert lost, "the test's step is not below bfloat16's resolution"
