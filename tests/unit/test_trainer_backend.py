"""The trainer backend seam: both backends are backend.TrainerBackend, each one module of the
registry (a new one is one file), the torch backend's optimizer state survives a checkpoint,
and the worker's save rule."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal.checkpoint import save as save_checkpoint
from areal.config import ConfigError, load_config
from areal.models.tiny import make_tiny_model
from areal.trainer import backends
from areal.trainer.backend import TrainerBackend
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import DataParallel
from areal.trainer.torch_backend import TorchBackend
from areal.trainer.worker import load_trainer_part, write_trainer_part
from areal.worker import make_backend as build_backend
from areal.worker import step_plan

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
        optimizer=OptimizerSpec(
            lr=1e-2,
            weight_decay=0.01,
            betas=(0.9, 0.999),
            adam_eps=1e-3,
            grad_clip=1.0,
            warmup_steps=4,  # the learning rate still ramps after the checkpoint
        ),
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


def test_each_trainer_backend_is_one_module_found_by_name():
    assert backends.names() == ("torch", "megatron")  # the default first
    for name in backends.names():
        assert backends.load_backend(name).name == name
    assert backends.load_backend("torch").in_process
    with pytest.raises(ConfigError, match="unknown trainer backend 'jax': use one of torch"):
        backends.load_backend("jax")


def test_a_megatron_config_loads_without_torch_or_megatron():
    """The registry and a backend's rules are cheap: only build imports the backend."""
    code = (
        "import sys; from areal.config import load_config\n"
        "load_config(None, ['trainer.backend=megatron', 'trainer.parallel.tp=2'])\n"
        "heavy = {'torch', 'megatron', 'areal.trainer.megatron', 'areal.trainer.torch_backend'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


ECHO = """
from areal.config_loader import ConfigError
from areal.trainer.backends import TrainerBackendSpec


class Echo(TrainerBackendSpec):
    name = "echo"

    def check(self, cfg):
        if cfg.model.lora.enabled:
            raise ConfigError("trainer.backend=echo trains no adapters")

    def build(self, cfg, model_dir, dp, optimizer):
        return {"model_dir": model_dir, "optimizer": optimizer}, dp


BACKEND = Echo()
"""


@pytest.fixture
def echo_backend(tmp_path, monkeypatch):
    """A backend written as one module beside the registry's own (its package path)."""
    (tmp_path / "echo.py").write_text(ECHO)
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    backends.names.cache_clear()
    backends.load_backend.cache_clear()
    yield
    sys.modules.pop("areal.trainer.backends.echo", None)
    vars(backends).pop("echo", None)  # the submodule's attribute on its package
    backends.names.cache_clear()
    backends.load_backend.cache_clear()


def test_a_new_trainer_backend_is_one_file(echo_backend):
    """Nothing but its module names it: the config accepts it, applies its rules, and
    make_backend builds it with the run's optimizer."""
    assert backends.names() == ("torch", "echo", "megatron")
    with pytest.raises(ConfigError, match="trainer.backend=echo trains no adapters"):
        load_config(None, ["trainer.backend=echo", "model.lora.rank=4"])
    cfg = load_config(None, ["trainer.backend=echo", "trainer.lr=3e-4"])
    dp = DataParallel()
    built, built_dp = build_backend(cfg, "some/model", dp)
    optimizer = OptimizerSpec.for_policy(cfg.trainer, cfg.total_train_steps * cfg.ppo.n_minibatches)
    assert built == {"model_dir": "some/model", "optimizer": optimizer}
    assert built_dp is dp and built["optimizer"].lr == 3e-4


def test_the_optimizer_spec_is_the_config_s():
    cfg = load_config(None, ["ppo.recipe=ppo", "critic.lr=1e-3", "total_train_steps=500"])
    n_updates = cfg.total_train_steps * cfg.ppo.n_minibatches
    policy = OptimizerSpec.for_policy(cfg.trainer, n_updates)
    critic = OptimizerSpec.for_critic(cfg.trainer, cfg.critic, n_updates)
    t = cfg.trainer
    assert (policy.lr, policy.weight_decay, policy.betas) == (t.lr, t.weight_decay, (0.9, 0.95))
    assert (policy.adam_eps, policy.grad_clip) == (t.adam_eps, t.grad_clip)
    assert policy.warmup_steps == int(t.warmup_steps_ratio * n_updates) > 0
    assert critic == OptimizerSpec(**{**vars(policy), "lr": 1e-3})
    ramp = [policy.lr_at(n) for n in (0, policy.warmup_steps - 1, 10**6)]
    assert ramp == pytest.approx([t.lr / policy.warmup_steps, t.lr, t.lr])


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
    cfg = load_config(
        None, ["total_train_steps=10", "trainer.save_freq_steps=4", "trainer.save_freq_s=60"]
    )
    plan = step_plan(cfg)
    assert [v for v in range(1, 11) if plan.save_rule(v, 0.0)] == [4, 8, 10]
    assert plan.save_rule(3, 60.0) and not plan.save_rule(3, 59.0)
    plan = dataclasses.replace(plan, save_freq_s=0.0)  # off
    assert not plan.save_rule(3, 1e9)


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
        model_dir, dtype="bfloat16", device="cpu", optimizer=OptimizerSpec(
            lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0,
            warmup_steps=0,
        ),
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
