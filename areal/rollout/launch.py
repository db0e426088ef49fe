"""Start inference server k on this node: `python -m areal.worker --role server --index k`.

    launcher --starts--> server role (this) --registers http://{node}:{port}--> registry
                                          '--exec--> python -m areal.rollout.server (or SGLang)

The server role runs on the node that will serve, so it alone can pick a free port there
and register the URL peers reach it at (AREAL_HOST, see comm/net.py); then it replaces
itself with the server process (exec), so the launcher's stop signals reach the server
directly. The rollout worker waits for /health, so registering before listening is safe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from areal.comm import net
from areal.comm.registry import Registry


def server_command(cfg, k: int, host: str, port: int) -> list[str]:
    """The command line of inference server k, listening on host:port."""
    if cfg.inference.backend != "embedded":
        raise ValueError(
            f"inference.backend={cfg.inference.backend!r} is not available yet; use embedded"
        )
    # A resumed run's servers start from the checkpoint's weights and version.
    ckpt = None
    if cfg.resume:
        from areal.checkpoint import latest  # imports torch: only when it is needed

        ckpt = latest(cfg.exp_dir)
    model, version = (str(ckpt.model_dir), ckpt.version) if ckpt else (cfg.model.path, 0)
    args = {
        "--model": model,
        "--host": host,
        "--port": port,
        "--max-batch-size": cfg.inference.max_batch_size,
        "--num-threads": cfg.inference.num_threads,
        "--seed": cfg.seed + k,
        "--weight-version": version,
    }
    python = cfg.inference.python or sys.executable
    return [python, "-m", "areal.rollout.server", *(str(x) for kv in args.items() for x in kv)]


def exec_server(cfg, k: int) -> None:
    """Register server k's URL, then become the server process; does not return."""
    host = net.bind_host()
    port = net.free_port(host)
    cmd = server_command(cfg, k, host, port)
    Registry(cfg.exp_dir).register("server", k, f"http://{net.advertised_host()}:{port}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)


def start_embedded_server(
    model: str | Path, log_path: Path, *args: str
) -> tuple[subprocess.Popen, str]:
    """The embedded server on a free loopback port, as a child that dies with this process
    (eval, benchmarks, tests); returns the process and its URL. Poll /health to know it
    is ready."""
    from areal.process import die_with_parent

    port = net.free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "areal.rollout.server", "--model", str(model)]
    cmd += ["--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"
