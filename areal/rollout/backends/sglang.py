"""SGLang (GPUs), run by its own interpreter (inference.python) at the release we speak.

Log-probs need no flag (each /generate asks for them with return_logprob); --weight-version
is what meta_info.weight_version reports until the first /update_weights_from_disk sets a
new one; the API key on its command line (shown as *** in the log).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from areal.config_loader import ConfigError
from areal.rollout.backends import InferenceBackend, check_owned_args, flat, start_weights
from areal.rollout.backends import version_problem as interpreter_problem

if TYPE_CHECKING:
    from areal.rollout.inference import ClientFactory

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release whose HTTP API we speak; pyproject's `sglang` extra pins the same."""

OWNED_ARGS = {
    "--model-path": "model.path or the resumed checkpoint",
    "--model": "model.path or the resumed checkpoint",
    "--host": "the node's address",
    "--port": "a free port",
    "--tp-size": "inference.tp_size",
    "--tp": "inference.tp_size",
    "--tensor-parallel-size": "inference.tp_size",
    "--mem-fraction-static": "inference.mem_fraction",
    "--random-seed": "seed",
    "--weight-version": "the run's weight version",
}
"""SGLang arguments the launcher derives from the config; inference.extra_args may not repeat
them (-> where the value comes from)."""


class SGLang(InferenceBackend):
    name = "sglang"
    group_backend = "nccl"  # its servers receive on their GPUs

    def check(self, cfg: Any) -> None:
        check_owned_args(cfg.inference.extra_args, OWNED_ARGS)
        if cfg.inference.server_keepalive_s:
            raise ConfigError(
                "inference.server_keepalive_s cannot be set for SGLang (its uvicorn keeps idle "
                "connections 5 s): remove it"
            )

    def client(self) -> ClientFactory:
        from areal.rollout.client import SGLangServerClient

        return SGLangServerClient

    def command(
        self, cfg: Any, k: int, host: str, port: int, api_key: str | None
    ) -> tuple[list[str], dict[str, str]]:
        inf = cfg.inference
        model, version = start_weights(cfg)
        args = {  # SGLang 0.5.x ServerArgs
            "--model-path": model,
            "--host": host,
            "--port": port,
            "--tp-size": inf.tp_size,
            "--mem-fraction-static": inf.mem_fraction,
            "--max-running-requests": inf.max_batch_size,
            "--dtype": cfg.model.dtype,
            "--random-seed": cfg.seed + k,
            "--weight-version": version,
        }
        lora = []
        if cfg.model.lora.enabled:  # adapters loaded by name at run time (client.py)
            lora = ["--enable-lora", "--max-lora-rank", str(cfg.model.lora.rank),
                    "--lora-target-modules", "all"]  # fmt: skip
        auth = ["--api-key", api_key] if api_key else []
        python = inf.python or sys.executable
        argv = [python, "-m", "sglang.launch_server", *flat(args), *lora, *auth, *inf.extra_args]
        return argv, dict(os.environ)

    def version_problem(self, python: str) -> str | None:
        return interpreter_problem(
            python, "sglang", "sglang", "SGLang", SUPPORTED_SGLANG,
            f"Install it in an environment of its own (`python -m venv ENV && ENV/bin/pip "
            f'install "sglang=={SUPPORTED_SGLANG}"`, or `pip install "areal[sglang]"`) and set '
            "inference.python=ENV/bin/python; inference.check_version=false skips this check "
            "at your own risk.",
        )  # fmt: skip


BACKEND = SGLang()
