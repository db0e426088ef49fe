"""Export a trained policy as one HF model directory (loadable by transformers, vLLM, SGLang).

    python -m areal.export RUN_OR_DIR --out DIR [--base MODEL_DIR]

RUN_OR_DIR is an experiment directory (its latest checkpoint), a checkpoint directory, a
checkpoint's model/, or a published version (weights/vN). A LoRA adapter (model.lora) is
merged into its base: W + (alpha / r) B A for each adapted layer (areal/lora.py), the base
being --base, else the adapter's base_model_name_or_path (the run's model.path). A whole
model is copied as it is. The tokenizer and generation files of the base come along.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from areal.checkpoint import latest
from areal.weights import ADAPTER_CONFIG, copy_companion_files, is_adapter_dir, write_atomically


def find_weights(source: Path) -> Path:
    """The model or adapter directory that `source` names (module docstring)."""
    if (source / "checkpoints").is_dir():
        ckpt = latest(source)
        if ckpt is None:
            raise ValueError(f"{source} has no complete checkpoint")
        return ckpt.model_dir
    if (source / "model").is_dir():
        return source / "model"
    if is_adapter_dir(source) or (source / "config.json").is_file():
        return source
    raise ValueError(
        f"{source} is neither an experiment directory, a checkpoint, a model directory nor "
        "an adapter directory"
    )


def export(source: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """Write the merged (or copied) HF model of `source` at out, atomically; returns out."""
    weights = find_weights(Path(source))
    out = Path(out)
    if not is_adapter_dir(weights):

        def copy(tmp: Path) -> None:
            shutil.copytree(weights, tmp, dirs_exist_ok=True)

        return write_atomically(out, copy)
    base = Path(
        base or json.loads((weights / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    )
    if not (base / "config.json").is_file():
        raise ValueError(f"the adapter's base model {base} is not a model directory: pass --base")

    def merge(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from areal.lora import merged_weights

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        state = model.state_dict()
        with torch.no_grad():
            for name, tensor in merged_weights(state, weights).items():
                state[name].copy_(tensor)
        model.save_pretrained(tmp, safe_serialization=True)
        copy_companion_files(base, tmp)

    return write_atomically(out, merge)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("source", help="experiment dir, checkpoint, model/ or weights/vN")
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    parser.add_argument("--base", default=None, help="a LoRA adapter's base model directory")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out, args.base)
    except ValueError as e:
        print(f"areal.export: {e}", file=sys.stderr)
        return 2
    print(f"areal.export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
