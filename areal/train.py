"""`python -m areal.train --config FILE [key.sub=value ...]`: config -> launcher -> exit code.

1) load and validate the config (fast: nothing heavy is imported before this)
2) prepare the experiment directory: key, config snapshot, logs, the model
3) start every role (locally, or as srun steps inside a SLURM allocation) and wait
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from areal.config import ConfigError, load_config, save_config


def prepare_experiment(cfg):
    """Make the experiment directory ready for a fresh or resumed run; resolve the model."""
    from areal.checkpoint import checkpoints_root, latest
    from areal.comm.registry import create_key

    if cfg.dataset.type != "arith":
        from areal.data.problems import load_file_rows

        # Every role must find the file whatever its working directory; a bad file is a
        # user mistake best reported now, before anything else.
        cfg.dataset.path = str(Path(cfg.dataset.path).resolve())
        n = len(load_file_rows(cfg.dataset.type, cfg.dataset.path))
        print(f"areal: {n} {cfg.dataset.type} problems in {cfg.dataset.path}")
    exp = cfg.exp_dir
    exp.mkdir(parents=True, exist_ok=True)
    ckpt = latest(exp) if cfg.resume else None
    # Neither kind of run may find the previous run's addresses, weights or logs.
    for name in ("weights", "logs"):
        shutil.rmtree(exp / name, ignore_errors=True)
    for entry in (exp / "registry").glob("*/"):
        shutil.rmtree(entry, ignore_errors=True)
    metrics = exp / "metrics.jsonl"
    if ckpt is None:
        if cfg.resume:
            print(f"areal: no checkpoint in {exp}; starting afresh")
        shutil.rmtree(checkpoints_root(exp), ignore_errors=True)
        metrics.unlink(missing_ok=True)
    else:
        print(f"areal: resuming from {ckpt.path}")
        # Steps after the checkpoint will be trained again: their lines go.
        if metrics.exists():
            lines = [
                ln
                for ln in metrics.read_text().splitlines()
                if ln.strip() and json.loads(ln)["version"] <= ckpt.version
            ]
            metrics.write_text("".join(ln + "\n" for ln in lines))
    (exp / "logs").mkdir()
    create_key(exp)
    if not cfg.model.path:
        from areal.models.tiny import make_tiny_model

        m = cfg.model
        name = (
            f"tiny-h{m.tiny_hidden}-l{m.tiny_layers}-w{m.tiny_warmup_steps}"
            f"-m{cfg.dataset.max_operand}-s{cfg.seed}"
        )
        print(f"areal: using the tiny model {Path(cfg.fileroot) / 'models' / name}")
        cfg.model.path = str(
            make_tiny_model(
                Path(cfg.fileroot) / "models" / name,
                seed=cfg.seed,
                hidden=m.tiny_hidden,
                layers=m.tiny_layers,
                warmup_steps=m.tiny_warmup_steps,
                max_operand=cfg.dataset.max_operand,
            )
        )
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path!r} holds no config.json: point it at a Hugging Face "
            "model directory (config.json, *.safetensors, tokenizer files), or leave it empty "
            "for the tiny model"
        )
    save_config(cfg, exp / "config.yaml")
    return ckpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.train", description="Run an asynchronous RL experiment."
    )
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-3")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        ckpt = prepare_experiment(cfg)
    except ConfigError as e:
        print(f"areal: config error: {e}", file=sys.stderr)
        return 2
    print(f"areal: experiment directory {cfg.exp_dir}")
    if ckpt is not None and ckpt.version >= cfg.total_train_steps:
        print(f"areal: the checkpoint already has {ckpt.version} of {cfg.total_train_steps} steps")
        return 0
    if cfg.launcher.type != "local":
        print(
            f"areal: launcher.type={cfg.launcher.type!r} is not available yet; use local",
            file=sys.stderr,
        )
        return 2
    from areal.launcher.local import LocalLauncher

    return LocalLauncher(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
