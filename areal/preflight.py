"""Start-up checks: what a run needs, checked before any process starts, each failure a
ConfigError naming the key and what to do.

    train.py --check_model_dir(model.path)--> config.json, tokenizer, chat template, weights
             --check_disk(fileroot, model.path)--> room under fileroot for checkpoints and weights

Only files are read (JSON, and the header of each safetensors file): nothing heavy is
imported, so a wrong directory is reported in well under a second, not after every role
has started, crashed and been restarted. (The dataset is checked by loading its rows,
train.py; ports are free ports picked by the launchers, so none is configured to check.)
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from areal.config import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file; ValueError if the file is not whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError("its header runs past the end of the file")
        header = json.loads(f.read(n))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ValueError(f"truncated: {size} bytes, its tensors need {8 + n + end}")
    return header


def weight_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors")) or sorted(model.glob("pytorch_model*.bin"))


def check_model_dir(path: str) -> None:
    """Every problem of a Hugging Face model directory at once, as one ConfigError."""
    model = Path(path)
    key = f"model.path={path!r}"
    if not model.is_dir():
        raise ConfigError(
            f"{key} is not a directory: point it at a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files), or leave it empty for the tiny model"
        )
    problems = []
    try:
        config = json.loads((model / "config.json").read_text())
        if "quantization_config" in config:
            problems.append(
                "its config.json has a quantization_config: a quantized model cannot be "
                "trained; use the unquantized weights"
            )
    except OSError:
        problems.append("no config.json")
    except ValueError as e:
        problems.append(f"config.json is not JSON ({e})")
    if not any((model / name).is_file() for name in _TOKENIZER_FILES):
        problems.append("no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    elif not _has_chat_template(model):
        problems.append(
            "the tokenizer has no chat template (every task renders its prompts with it: "
            "chat_template in tokenizer_config.json, or chat_template.jinja)"
        )
    files = weight_files(model)
    index = model / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
            missing = sorted(s for s in shards if not (model / s).is_file())
            if missing:
                problems.append(f"weight shards listed in {index.name} are missing: {missing}")
        except (ValueError, KeyError) as e:
            problems.append(f"{index.name} is unreadable ({e})")
    if not files:
        problems.append("no weights (*.safetensors or pytorch_model*.bin)")
    for f in files:
        if f.suffix != ".safetensors":
            continue
        try:
            header = safetensors_header(f)
        except (OSError, ValueError) as e:
            problems.append(f"{f.name} cannot be loaded: {e}")
            continue
        odd = {t["dtype"] for k, t in header.items() if k != "__metadata__"} - set(_FLOAT_DTYPES)
        if odd:
            problems.append(
                f"{f.name} holds {sorted(odd)} tensors: only float32/bfloat16/float16 "
                "weights are trained (model.dtype)"
            )
    if problems:
        raise ConfigError(
            f"{key} is not a usable model directory: "
            + "; ".join(problems)
            + ". Point model.path at a complete Hugging Face model directory (e.g. one that "
            "huggingface-cli download or save_pretrained wrote, with its tokenizer), or "
            "leave it empty for the tiny model"
        )


def n_params(model: Path) -> int:
    """Parameters in the model's safetensors files (0 if it has none)."""
    total = 0
    for f in model.glob("*.safetensors"):
        for k, t in safetensors_header(f).items():
            if k != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n
    return total


def checkpoint_bytes(params: int, save_dtype: str, lora: bool) -> int:
    """What a run writes at its peak: two checkpoints (the new one beside the last while it
    is saved) of the model and fp32 Adam's two moments, and two published versions. A
    LoRA run's adapters are small: its checkpoints are counted as the published weights."""
    model = params * _DTYPE_BYTES.get(save_dtype, 4)
    if lora:
        return 2 * model  # the base is not saved; a generous bound for the adapters
    return 2 * (model + params * 8) + 2 * model


def check_disk(fileroot: str, model_path: str, *, save_dtype: str, lora: bool) -> None:
    """Enough free space under fileroot for the run's checkpoints and weights
    (trainer.save_dtype; model.lora's adapters are small)."""
    need = checkpoint_bytes(n_params(Path(model_path)), save_dtype, lora)
    root = Path(fileroot).resolve()
    while not root.exists():  # the directory is made later; its volume is the parent's
        root = root.parent
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError(
            f"fileroot={fileroot!r} has {free / 2**30:.1f} GiB free, and this run's "
            f"checkpoints and weights need about {need / 2**30:.1f} GiB (two checkpoints of "
            "the model and its Adam state, two published versions): free space there, or "
            "point fileroot at a larger volume"
        )
