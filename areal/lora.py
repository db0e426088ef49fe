"""LoRA: low-rank adapters on a frozen base, trained, handed off and merged (model.lora).

    y = W x + (alpha / r) * B (A dropout(x))        A: [r, in], B: [out, r], B = 0 at start

    trainer: apply_lora(model) wraps the targeted nn.Linear layers in LoRALinear; only A and
             B are trainable (the optimizer holds their state alone)
    publish: save_adapter(model, dir) -> dir/adapter_model.safetensors + adapter_config.json
             (PEFT's format: vLLM's /v1/load_lora_adapter, SGLang's /load_lora_adapter and
             peft all read it), megabytes where the model is gigabytes
    serve:   merged_weights(base, adapter): W + (alpha / r) B A for each targeted layer (the
             embedded engine, areal.export); vLLM and SGLang apply it unmerged

A small layer rather than the peft library: peft would add a dependency (and its pins on
transformers and accelerate) for what is here ~150 lines, and this layer's forward is the
formula above and nothing else (tests/unit/test_lora.py checks it against a merged linear,
and vLLM reads what it saves).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from areal.weights import ADAPTER_CONFIG, is_adapter_dir

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
"""target_modules entry: every nn.Linear of the decoder layers (not the LM head)."""
_PREFIX = "base_model.model."  # PEFT's prefix of every adapter tensor name


@dataclass(frozen=True)
class LoRASpec:
    """What an adapter is: its rank, scale numerator, dropout and targeted module suffixes."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(torch.nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (the formula of the module doc)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.scale = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        # float32 whatever the base's dtype: Adam's updates must not round away.
        kw = dict(device=base.weight.device, dtype=torch.float32)
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features, **kw))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's init; B = 0

    @property
    def weight(self) -> torch.Tensor:  # for code that reads a linear's weight (dtype, device)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        update = (self.dropout(x) @ self.lora_A.to(x.dtype).T) @ self.lora_B.to(x.dtype).T
        return self.base(x) + self.scale * update

    def delta(self) -> torch.Tensor:
        """The merged update (alpha / r) B A: [out, in], float32."""
        return self.scale * (self.lora_B.detach() @ self.lora_A.detach())


def _targets(model: torch.nn.Module, target_modules: tuple[str, ...]) -> list[str]:
    """Names of the nn.Linear modules target_modules selects (by last name component)."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is lm_head:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if ALL_LINEAR in target_modules or leaf in target_modules:
            names.append(name)
    return names


def apply_lora(model: torch.nn.Module, spec: LoRASpec) -> list[str]:
    """Freeze the model and wrap each targeted linear in a LoRALinear; returns their names.
    ValueError when target_modules selects nothing."""
    model.requires_grad_(False)
    names = _targets(model, spec.target_modules)
    if not names:
        raise ValueError(
            f"model.lora.target_modules={list(spec.target_modules)} matches no linear layer "
            f"of the model: name the layers' last names (q_proj, down_proj, ...) or {ALL_LINEAR}"
        )
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), spec.rank, spec.alpha,
                                         spec.dropout))  # fmt: skip
    return names


def lora_layers(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names (base_model.model.<layer>.lora_A.weight)."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[f"{_PREFIX}{name}.lora_A.weight"] = layer.lora_A.detach().contiguous().cpu()
        out[f"{_PREFIX}{name}.lora_B.weight"] = layer.lora_B.detach().contiguous().cpu()
    return out


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter_tensors() output back into the model's LoRA layers (checked by name)."""
    layers = lora_layers(model)
    expected = {f"{_PREFIX}{n}.lora_{ab}.weight" for n in layers for ab in "AB"}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")  # fmt: skip
    with torch.no_grad():
        for name, layer in layers.items():
            layer.lora_A.copy_(tensors[f"{_PREFIX}{name}.lora_A.weight"])
            layer.lora_B.copy_(tensors[f"{_PREFIX}{name}.lora_B.weight"])


def peft_config(spec: LoRASpec, leaves: list[str], base_model: str = "") -> dict:
    """adapter_config.json of an adapter of `spec` on the layers named `leaves` (PEFT's)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        # Explicit names: vLLM and SGLang do not read "all-linear".
        "target_modules": sorted(leaves),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def adapter_leaves(names: Iterable[str]) -> list[str]:
    """The last names of the layers that adapter tensor names (PEFT's) change: q_proj, ..."""
    return sorted({layer_of(n).rsplit(".", 1)[-1] for n in names})


def layer_of(name: str) -> str:
    """The layer of an adapter tensor's PEFT name (base_model.model.<layer>.lora_A.weight),
    or the name itself when it is none."""
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        if name.startswith(_PREFIX) and name.endswith(suffix):
            return name[len(_PREFIX) : -len(suffix)]
    return name


def merged_cost(
    named: Iterable[tuple[str, torch.Tensor]], itemsize: int
) -> Callable[[str, torch.Tensor], int]:
    """weight_group.buckets()' cost of adapter tensors (PEFT's names, a layer's A before its
    B): the bytes of the weight the layer's merge makes (out x in x itemsize, the server's
    dtype), counted on A, 0 on B; a server holds a bucket's merged weights beside its own,
    and those, not the adapter's few bytes, are what bucket_mb bounds."""
    tensors = dict(named)

    def cost(name: str, t: torch.Tensor) -> int:  # A: [r, in], its B: [out, r]
        if not name.endswith(".lora_A.weight"):
            return 0
        return tensors[name.replace(".lora_A.", ".lora_B.")].shape[0] * t.shape[1] * itemsize

    return cost


def write_adapter(out: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """out/adapter_model.safetensors + out/adapter_config.json (PEFT's format)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


def save_adapter(
    model: torch.nn.Module, out: str | Path, spec: LoRASpec, base_model: str = ""
) -> None:
    """out/adapter_model.safetensors + out/adapter_config.json, in PEFT's format."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in lora_layers(model)})
    write_adapter(out, adapter_tensors(model), peft_config(spec, leaves, base_model))


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of an adapter directory; ValueError if it is not one."""
    path = Path(path)
    if not is_adapter_dir(path) or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{path} is not an adapter directory ({ADAPTER_CONFIG} + "
                         f"{ADAPTER_WEIGHTS})")  # fmt: skip
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{path}: only plain LoRA adapters are supported")
    return config, load_file(path / ADAPTER_WEIGHTS)


def adapter_layers(path: str | Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(alpha / r, {"<layer>.weight": (A, B)}) of an adapter directory."""
    config, tensors = read_adapter(path)
    return layers_of(config, tensors)


def layers_of(
    config: dict, tensors: dict[str, torch.Tensor]
) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(alpha / r, {"<layer>.weight": (A, B)}) of an adapter's config (PEFT's r and
    lora_alpha) and tensors (PEFT's names). ValueError when a layer lacks A or B."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    layers = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            b_key = key.replace(".lora_A.", ".lora_B.")
            if b_key not in tensors:
                raise ValueError(f"the adapter has {key} without {b_key}")
            layers[f"{layer_of(key)}.weight"] = (a, tensors[b_key])
    unpaired = [k for k in tensors if k.endswith(".lora_B.weight")
                and k.replace(".lora_B.", ".lora_A.") not in tensors]  # fmt: skip
    if unpaired:
        raise ValueError(f"the adapter has {unpaired[0]} without its lora_A")
    return scale, layers


def check_wire_config(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError unless config (an adapter's r, lora_alpha and target_modules, as an update
    request carries them) fits the adapter tensors received: PEFT's names, rank r, layers
    of the target modules only."""
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_config.r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"lora_config.lora_alpha must be a number, got {alpha!r}")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"lora_config.target_modules must be a list of names, got {targets!r}")
    for name, t in tensors.items():
        layer = layer_of(name)
        if layer == name:
            raise ValueError(
                f"{name} is not an adapter tensor ({_PREFIX}<layer>.lora_A.weight or "
                ".lora_B.weight)"
            )
        if layer.rsplit(".", 1)[-1] not in targets:
            raise ValueError(f"{name} changes a layer outside target_modules {targets}")
        rank = t.shape[0] if name.endswith(".lora_A.weight") else t.shape[-1]
        if t.dim() != 2 or rank != r:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, not one of rank r={r}")


def merge_layers(
    base: dict[str, torch.Tensor],
    scale: float,
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The weights base + the layers' changes (only those): W + scale B A, computed in
    float32 and returned in W's dtype. ValueError naming a layer the base lacks or whose
    shape differs. One function for an adapter from disk and from a weight-update group,
    so that both give the same bits."""
    out = {}
    for name, (a, b) in layers.items():
        if name not in base:
            raise ValueError(f"the adapter changes {name}, which the base model lacks")
        w = base[name]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"the adapter's {name} is {(b.shape[0], a.shape[1])}, the base's "
                             f"{tuple(w.shape)}")  # fmt: skip
        a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
        out[name] = torch.addmm(w.float(), b, a, alpha=scale).to(w.dtype)
    return out


def merged_weights(
    base: dict[str, torch.Tensor], adapter_dir: str | Path
) -> dict[str, torch.Tensor]:
    """merge_layers of an adapter directory."""
    return merge_layers(base, *adapter_layers(adapter_dir))


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every LoRALinear by its base linear with the update merged in (in place)."""
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            w = layer.base.weight
            w.copy_((w.float() + layer.delta().to(w.device)).to(w.dtype))
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, layer.base)
    return model
