"""The embedded server (areal/rollout/server.py): torch on CPU or one GPU, SGLang's HTTP API.

It runs in this environment, needs no version check, and its torch threads take part in the
core ledger (0 threads: its share of the node's cores, lent while it waits). Weight loads
only from the run's own directories (`--weights-root`); the API key in its environment.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from areal.config_loader import ConfigError
from areal.rollout.backends import InferenceBackend, flat, start_weights, weights_roots

if TYPE_CHECKING:
    from areal.rollout.inference import ClientFactory


class Embedded(InferenceBackend):
    name = "embedded"
    lends_cores = True
    in_process = True  # DecodeEngine + EngineClient (areal/inline.py)
    takes_deltas = True
    takes_adapter_tensors = True  # merged as an adapter directory is (weight_loading.py)

    def group_ranks(self, inference: Any) -> int:
        return 1  # one process, whatever inference.tp_size says

    def check(self, cfg: Any) -> None:
        if cfg.inference.extra_args:
            raise ConfigError(
                "inference.extra_args is for SGLang's or vLLM's command line, but "
                "inference.backend='embedded': set inference.backend=sglang or vllm, or remove it"
            )
        budget = cfg.inference.max_total_tokens
        longest = cfg.dataset.max_prompt_len + cfg.rollout.max_new_tokens
        if 0 < budget < longest:
            # Fail now, not with a 400 from the server in the middle of the run.
            raise ConfigError(
                f"inference.max_total_tokens={budget} cannot hold one request of "
                f"dataset.max_prompt_len + rollout.max_new_tokens = {longest} tokens: raise "
                "it (0 = a quarter of free memory) or lower those"
            )

    def client(self) -> ClientFactory:
        from areal.rollout.client import SGLangClient  # it speaks SGLang's HTTP API

        return SGLangClient

    def command(
        self, cfg: Any, k: int, host: str, port: int, api_key: str | None
    ) -> tuple[list[str], dict[str, str]]:
        from areal.events import events_path
        from areal.rollout.auth import API_KEY_ENV

        inf = cfg.inference
        model, version = start_weights(cfg)
        args = {
            "--model": model,
            "--host": host,
            "--port": port,
            "--max-batch-size": inf.max_batch_size,
            "--max-total-tokens": inf.max_total_tokens,
            # 0: resolved by the server from its step's environment (its share of the
            # node's cores, and the ledger through which it lends and borrows them).
            "--num-threads": inf.num_threads,
            "--seed": cfg.seed + k,
            "--dtype": cfg.model.dtype,
            "--weight-version": version,
            "--weights-group-timeout-s": cfg.weights.timeout_s,
        }
        if cfg.stats.events:
            args["--events-file"] = events_path(cfg.exp_dir, f"server{k}")
        if inf.server_keepalive_s:
            args["--keepalive-s"] = inf.server_keepalive_s
        roots = [x for root in weights_roots(cfg) for x in ("--weights-root", root)]
        argv = [inf.python or sys.executable, "-m", "areal.rollout.server", *flat(args), *roots]
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else dict(os.environ)
        return argv, env


BACKEND = Embedded()
