"""The config tree: defaults, YAML + overrides, error messages, round trips, key docs."""

import dataclasses
import inspect
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal import config_loader
from areal.config import (
    ConfigError,
    ExperimentConfig,
    MicroBatchSpec,
    TrainerConfig,
    WeightsConfig,
    describe_keys,
    from_dict,
    load_config,
    save_config,
    to_dict,
)
from areal.trainer.ppo_config import PPOConfig

REPO = Path(__file__).resolve().parents[2]


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" != "dataset.options":  # a plugin's: one leaf
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_valid_and_match_the_paper() -> None:
    cfg = load_config()
    assert cfg == ExperimentConfig()
    assert cfg.exp_dir == Path("/tmp/areal/tiny/run0")
    assert cfg.trainer.lr == 2e-5 and cfg.trainer.betas == [0.9, 0.95]
    assert cfg.trainer.mb_spec.max_tokens_per_mb == 32768
    assert (cfg.reward.correct, cfg.reward.wrong) == (5.0, -5.0)
    assert cfg.ppo.behav_imp_weight_cap is None


def test_yaml_then_overrides_win(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "experiment_name: exp\n"
        "trainer:\n  lr: 1e-4\n  mb_spec: {max_tokens_per_mb: 4096, min_n_mbs: 2}\n"
        "rollout: {group_size: 4}\n",
    )
    cfg = load_config(path, ["trainer.lr=3e-4", "trainer.mb_spec={min_n_mbs: 3}", "seed=7"])
    assert cfg.trainer.lr == 3e-4  # override beats file
    assert cfg.trainer.mb_spec == MicroBatchSpec(max_tokens_per_mb=4096, min_n_mbs=3)
    assert cfg.rollout.group_size == 4  # file beats default
    assert cfg.experiment_name == "exp" and cfg.seed == 7
    assert cfg.rollout.max_new_tokens == 8  # untouched default
    assert cfg.exp_dir == Path("/tmp/areal/exp/run0")
    # Without overrides the file's value stands; `1e-4` (no dot) must read as a float.
    assert load_config(path).trainer.lr == 1e-4


def test_value_parsing() -> None:
    cfg = load_config(
        None,
        [
            "trainer.lr=1",  # int accepted for float, stored as float
            "ppo.behav_imp_weight_cap=5",
            "rollout.interruptible=false",
            "trainer.betas=[0.9,0.99]",
            "model.path=/models/x",
        ],
    )
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float)
    assert cfg.ppo.behav_imp_weight_cap == 5.0
    assert cfg.rollout.interruptible is False
    assert cfg.trainer.betas == [0.9, 0.99]
    assert cfg.model.path == "/models/x"
    assert load_config(None, ["ppo.behav_imp_weight_cap=null"]).ppo.behav_imp_weight_cap is None


def test_empty_file_and_empty_section_mean_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "")) == ExperimentConfig()
    assert load_config(_write(tmp_path, "trainer:\n  # lr: 1.0\n")) == ExperimentConfig()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.lrr=1"], ["unknown config key 'trainer.lrr'", "did you mean 'trainer.lr'?"]),
        (["lr=1"], ["'lr'", "did you mean 'trainer.lr' or 'critic.lr'?"]),
        (["trainer.mb_spec.max_tokens=9"], ["'trainer.mb_spec.max_tokens_per_mb'"]),
        (["trainer.zzzzzz=1"], ["'trainer.zzzzzz'", "valid keys of 'trainer'", "batch_size"]),
        (["trainer.lr=fast"], ["trainer.lr expects a float, got 'fast' (str)"]),
        (["trainer.lr=true"], ["trainer.lr expects a float", "(bool)"]),
        (["trainer.batch_size=true"], ["trainer.batch_size expects an int", "(bool)"]),
        (["trainer.batch_size=1.5"], ["trainer.batch_size expects an int, got 1.5 (float)"]),
        (["trainer.lr={a: 1}"], ["trainer.lr expects a float", "not a section"]),
        (["trainer=5"], ["trainer is a section", "got 5"]),
        (["trainer.mb_spec=3"], ["trainer.mb_spec is a section"]),
        (["rollout.interruptible=1"], ["rollout.interruptible expects a bool"]),
        (["ppo.eps_clip=tight"], ["ppo.eps_clip expects a float or null"]),
        (["ppo.behav_imp_weight_cap=big"], ["ppo.behav_imp_weight_cap expects a float or null"]),
        (["trainer.betas=[0.9, x]"], ["trainer.betas expects a list of floats"]),
        (["trainer.betas=0.9"], ["trainer.betas expects a list of floats"]),
        (["trainer.betas=[0.9]"], ["trainer.betas", "two numbers"]),
        (["trainer.lr"], ["'trainer.lr' has no '='", "key=value"]),
        (["trainer.lr=[1,"], ["override 'trainer.lr=[1,'", "cannot parse"]),
        (["trainer.lr=0"], ["trainer.lr must be > 0"]),
        (
            ["trainer.mb_spec.max_tokens_per_mb=0"],
            ["trainer.mb_spec.max_tokens_per_mb must be > 0"],
        ),
        (["rollout.group_size=0"], ["rollout.group_size must be > 0"]),
        (["rollout.top_p=1.5"], ["rollout.top_p must be in (0, 1]"]),
        (["rollout.top_k=0"], ["rollout.top_k must be -1 (off) or > 0"]),
        (["inference.startup_timeout_s=0"], ["inference.startup_timeout_s"]),
        (["max_staleness=-1"], ["max_staleness must be >= 0"]),
        (["dataset.type=foo"], ["dataset.type must be one of arith, longtail", "'foo'"]),
        (["dataset.type=math"], ["dataset.path is required", "'math'"]),
        (["trainer.backend=jax"], ["trainer.backend must be one of torch, megatron"]),
        (["inference.backend=trt"], ["inference.backend must be one of embedded, sglang, vllm"]),
        (["inference.backend=vllm"], ["heads of at least 32", "model.tiny_heads=2"]),
        (["model.tiny_heads=3"], ["model.tiny_heads must divide tiny_hidden=64"]),
        (["model.dtype=fp8"], ["model.dtype must be one of float32, bfloat16, float16"]),
        (["ppo.adv_norm=mean"], ["ppo.adv_norm must be one of batch, group"]),
        (["launcher.type=k8s"], ["launcher.type must be one of local, slurm"]),
        (["ppo.eps_clip=1.5"], ["ppo.eps_clip must be in (0, 1]"]),
        (["ppo.behav_imp_weight_cap=0.5"], ["ppo.behav_imp_weight_cap must be > 1 or null"]),
        (["reward.correct=-6"], ["reward.correct", "reward.wrong"]),
        (["trial_name=a/b"], ["trial_name must be one directory name"]),
        (["ppo.adv_norm=group", "rollout.group_size=1"], ["ppo.adv_norm=group", "group_size"]),
        (["ppo.n_minibatches=1000"], ["ppo.n_minibatches", "trainer.batch_size"]),
        (["weights.transport=rdma"], ["weights.transport must be one of disk, distributed"]),
        (["weights.disk_every=0"], ["weights.disk_every must be > 0"]),
        (["weights.delta=true"], ["weights.delta", "weights.transport=distributed"]),
        (
            ["weights.transport=distributed", "model.lora.rank=4", "inference.backend=vllm"],
            [
                "model.lora with weights.transport=distributed needs inference.backend=embedded",
                "vllm's servers load each adapter by path",
                "use weights.transport=disk",
            ],
        ),  # fmt: skip
        (
            ["weights.transport=distributed", "model.lora.rank=4", "inference.backend=sglang"],
            ["needs inference.backend=embedded", "sglang's servers"],
        ),
        (
            ["weights.transport=distributed", "model.lora.rank=4", "weights.delta=true"],
            ["weights.delta with model.lora", "set weights.delta=false"],
        ),
        (
            ["weights.transport=distributed", "launcher.type=inline"],
            ["weights.transport=distributed: launcher.type=inline"],
        ),
        (
            ["weights.transport=distributed", "weights.delta=true", "inference.backend=sglang"],
            ["weights.delta needs inference.backend=embedded"],
        ),
    ],
)
def test_override_errors_name_the_key(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for text in expected:
        assert text in str(info.value)


def test_valid_edge_values_pass() -> None:
    cfg = load_config(None, ["max_staleness=0", "dataset.type=math", "dataset.path=/d.jsonl"])
    assert cfg.max_staleness == 0 and cfg.dataset.path == "/d.jsonl"
    assert load_config(None, ["trainer.backend=megatron"]).trainer.backend == "megatron"
    # A LoRA run sends its adapter over the weight-update group to embedded servers.
    cfg = load_config(None, ["weights.transport=distributed", "model.lora.rank=4"])
    assert cfg.weights.transport == "distributed" and cfg.model.lora.rank == 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer:\n  lrr: 1.0\n", ["unknown config key 'trainer.lrr'", "'trainer.lr'"]),
        ("trainer:\n  mb_spec:\n    min_nmbs: 2\n", ["'trainer.mb_spec.min_nmbs'", "min_n_mbs"]),
        ("trainer: 3\n", ["trainer is a section"]),
        ("trainer:\n  lr: [1]\n", ["trainer.lr expects a float, got [1] (list)"]),
        ("- a\n- b\n", ["must hold a mapping"]),
        ("trainer:\n  lr: 1.0\n bad: [\n", ["cannot parse config file", "line 3"]),
    ],
)
def test_file_errors(tmp_path: Path, text: str, expected: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    for part in expected:
        assert part in str(info.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert missing in str(info.value)


def test_override_on_a_file_scalar_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer is a section"):
        load_config(_write(tmp_path, "trainer: 3\n"), ["trainer.lr=1.0"])


def test_direct_construction_validates_with_dotted_keys() -> None:
    with pytest.raises(ValueError, match=r"trainer\.lr must be > 0"):
        TrainerConfig(lr=-1.0)
    with pytest.raises(ValueError, match=r"trainer\.mb_spec\.max_tokens_per_mb"):
        MicroBatchSpec(max_tokens_per_mb=0)
    with pytest.raises(ValueError, match=r"trainer\.lr expects a float"):
        TrainerConfig(lr="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TrainerConfig(0.1)  # type: ignore[misc]  # keyword-only


def test_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "experiment_name=rt",
            "trainer.lr=3e-6",
            "trainer.betas=[0.8, 0.9]",
            "trainer.mb_spec.min_n_mbs=2",
            "ppo.behav_imp_weight_cap=5.0",
            "rollout.interruptible=false",
            "reward.timeout_s=3",
        ],
    )
    path = tmp_path / "sub" / "saved.yaml"
    save_config(cfg, path)
    assert load_config(str(path)) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    assert to_dict(cfg)["trainer"]["mb_spec"] == {"max_tokens_per_mb": 32768, "min_n_mbs": 2}


def test_from_dict_validates() -> None:
    with pytest.raises(ConfigError, match="did you mean 'ppo.eps_clip'"):
        from_dict({"ppo": {"eps_clp": 0.1}})
    with pytest.raises(ConfigError, match="rollout.group_size must be > 0"):
        from_dict({"rollout": {"group_size": 0}})


def test_describe_keys_covers_every_leaf_with_docs() -> None:
    rows = describe_keys()
    keys = [key for key, _, _ in rows]
    assert keys == list(_leaves(to_dict(ExperimentConfig())))
    defaults = {key: default for key, default, _ in rows}
    assert defaults["trainer.lr"] == "2e-05"
    assert defaults["ppo.behav_imp_weight_cap"] == "null"
    assert defaults["trainer.mb_spec.max_tokens_per_mb"] == "32768"
    for key, _, doc in rows:
        assert doc, f"{key} has no docstring"
    assert "eta" in {k: d for k, _, d in rows}["max_staleness"]


def test_every_field_including_sections_has_a_docstring() -> None:
    for key, f, owner in config_loader.walk(ExperimentConfig):
        docs = config_loader._field_docs(inspect.getsourcefile(owner))
        assert docs.get((owner.__name__, f.name)), f"{key} has no docstring"
    assert all(dataclasses.is_dataclass(t) for t in (ExperimentConfig, TrainerConfig))


def test_cli_error_is_fast_and_light() -> None:
    code = (
        "import sys; from areal.config import load_config\n"
        "try:\n    load_config(None, ['trainer.lrr=1'])\n"
        "except ValueError as e:\n"
        "    assert 'torch' not in sys.modules, 'config must not import torch'\n"
        "    sys.exit(str(e))\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "did you mean 'trainer.lr'?" in proc.stderr
    assert elapsed < 6.0, f"loading a config took {elapsed:.2f}s"


def test_the_objectives_config_is_its_own_torch_free_module() -> None:
    code = (
        "import sys\n"
        "from areal.trainer.ppo_config import RECIPES, PPOConfig\n"
        "assert 'torch' not in sys.modules and 'areal.config' not in sys.modules\n"
        "print(PPOConfig(recipe='dapo').summary(), len(RECIPES))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("recipe=dapo decoupled")


def test_a_sections_own_rule_is_checked_by_the_section() -> None:
    with pytest.raises(ConfigError, match="weights.delta .* needs weights.transport=distributed"):
        WeightsConfig(delta=True)
    assert WeightsConfig(delta=True, transport="distributed").delta
    # The objective's rules against the run's batch are the ppo section's own, too.
    with pytest.raises(ConfigError, match="ppo.adv_estimator=grpo needs rollout.group_size >= 2"):
        PPOConfig(recipe="grpo").for_run(group_size=1, max_new_tokens=8, batch_size=4, dp=1)
    filled = PPOConfig().for_run(group_size=8, max_new_tokens=10, batch_size=4, dp=1)
    assert (filled.loss_agg_norm_len, filled.overlong_buffer) == (10, 2)


def test_module_main_prints_resolved_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "areal.config", "trainer.lr=0.5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "lr: 0.5" in proc.stdout


def test_a_kv_cache_budget_that_cannot_hold_one_request_is_refused():
    with pytest.raises(ConfigError, match="inference.max_total_tokens=100 cannot hold"):
        load_config(None, ["inference.max_total_tokens=100", "rollout.max_new_tokens=64"])
    cfg = load_config(None, ["inference.max_total_tokens=2048", "dataset.max_prompt_len=512"])
    assert cfg.inference.max_total_tokens == 2048


def test_a_tasks_own_options_are_checked_as_the_configs_are() -> None:
    cfg = load_config(None, ["dataset.options.max_operand=9"])
    assert cfg.dataset.options == {"max_operand": 9}
    assert load_config(None).dataset.options == {"max_operand": 5}  # the task's default
    assert from_dict(to_dict(cfg)) == cfg
    for overrides, expected in [
        (["dataset.options.max_operan=3"], "did you mean 'dataset.options.max_operand'"),
        (["dataset.options.max_operand=0"], "dataset.options.max_operand must be > 0"),
        (["dataset.options.max_operand=x"], "dataset.options.max_operand expects an int"),
        (["dataset.options=3"], "dataset.options expects a mapping"),
        (
            ["dataset.type=longtail", "dataset.options.max_operand=3"],
            "task 'longtail' takes no options",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_config(None, overrides)
