"""A directory holding a run: resumed when the config is the same, refused otherwise,
moved aside (never deleted) with overwrite=true; the refusal changes nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from areal.config import ConfigError, load_config, save_config
from areal.run_dir import claim as claim_dir


def claim(cfg) -> None:
    """As train.prepare_experiment claims the directory."""
    overwrite, cfg.overwrite = cfg.overwrite, False
    cfg.resume = claim_dir(cfg.exp_dir, cfg.to_dict(), resume=cfg.resume, overwrite=overwrite)


def tree_hash(root: Path) -> str:
    """sha256 over every file's relative path and bytes."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def held_run(tmp_path: Path, *overrides: str):
    cfg = load_config(None, [f"fileroot={tmp_path}", *overrides])
    exp = cfg.exp_dir
    (exp / "checkpoints/v000002").mkdir(parents=True)
    (exp / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    cfg.model.path = str(tmp_path / "models/tiny-arith-h64-l2-abc")  # as train.py resolves it
    save_config(cfg, exp / "config.yaml")
    return exp


def test_the_same_config_resumes_and_says_so(tmp_path, capsys):
    exp = held_run(tmp_path)
    cfg = load_config(None, [f"fileroot={tmp_path}"])
    claim(cfg)
    assert cfg.resume is True
    assert f"{exp} holds a run with this same config: resuming it" in capsys.readouterr().out


def test_another_config_is_refused_and_nothing_changes(tmp_path):
    exp = held_run(tmp_path)
    before = tree_hash(exp)
    cfg = load_config(None, [f"fileroot={tmp_path}", "model.lora.rank=16"])
    with pytest.raises(ConfigError) as e:
        claim(cfg)
    msg = str(e.value)
    assert str(exp) in msg and "model.lora.rank: 0 -> 16" in msg
    for way in ("trial_name=NAME", "resume=true", "overwrite=true"):
        assert way in msg
    assert tree_hash(exp) == before and not cfg.resume


def test_overwrite_moves_the_run_aside_whole(tmp_path, capsys):
    exp = held_run(tmp_path)
    before = tree_hash(exp)
    cfg = load_config(None, [f"fileroot={tmp_path}", "model.lora.rank=16", "overwrite=true"])
    claim(cfg)
    (aside,) = exp.parent.glob(f"{exp.name}.old-*")
    assert not exp.exists() and tree_hash(aside) == before
    assert f"moved the run that was in {exp} to {aside}" in capsys.readouterr().out
    assert cfg.overwrite is False and cfg.resume is False  # a recovery then resumes


def test_an_empty_or_new_directory_starts_afresh(tmp_path):
    cfg = load_config(None, [f"fileroot={tmp_path}"])
    cfg.exp_dir.mkdir(parents=True)
    (cfg.exp_dir / "logs").mkdir()  # a start that failed before writing its config
    claim(cfg)
    assert cfg.resume is False


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ConfigError, match="overwrite"):
        load_config(None, ["resume=true", "overwrite=true"])
