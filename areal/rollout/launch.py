"""Start inference server k on this node: `python -m areal.worker --role server --index k`.

    launcher --starts--> server role (this) --registers http://{node}:{port}--> registry
                                          '--exec--> python -m areal.rollout.server (or SGLang)

The server role runs on the node that will serve, so it alone can pick a free port there
and register the URL peers reach it at (AREAL_HOST, see comm/net.py); then it replaces
itself with the server process (exec), so the launcher's stop signals reach the server
directly. The rollout worker waits for /health, so registering before listening is safe.

The command line, environment and version check are the backend's (areal/rollout/backends/).
Before exec the role prints the command line as the first line of its log
(logs/server{k}.log) and, unless inference.check_version=false, asks the backend whether
inference.python can serve (SGLang's and vLLM's supported release). A server that does not
become healthy is reported by `wait_for_server` with that command line and the log's last
lines. Every server of a run requires the run's API key (areal/rollout/auth.py) and loads
weights only from under the experiment directory and the model path. GPUs: the server uses
every GPU it sees, so CUDA_VISIBLE_DEVICES must name its own (srun sets it for a SLURM step;
plan.Step.gpu_ids says which for a launcher that sets it itself).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from areal.comm import net
from areal.comm.registry import Registry
from areal.config import ExperimentConfig
from areal.rollout.auth import API_KEY_ENV, api_key
from areal.rollout.backends import load_backend
from areal.rollout.inference import InferenceClient

COMMAND_PREFIX = "areal: server command: "
"""Start of the first line of a server's log: the command line that started it."""


def redacted(cmd: list[str]) -> list[str]:
    """cmd with the value after --api-key hidden, for logs."""
    return ["***" if i > 0 and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]


def exec_server(cfg: ExperimentConfig, k: int) -> None:
    """Register server k's URL, then become the server process; does not return."""
    host = net.bind_host()
    port = net.free_port(host)
    backend = load_backend(cfg.inference.backend)
    cmd, env = backend.command(cfg, k, host, port, api_key(cfg.exp_dir))
    print(COMMAND_PREFIX + shlex.join(redacted(cmd)), flush=True)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"areal: CUDA_VISIBLE_DEVICES={gpus if gpus is not None else '(unset)'}", flush=True)
    if cfg.inference.check_version:
        problem = backend.version_problem(cmd[0])
        if problem:
            print(f"areal: {problem}", file=sys.stderr, flush=True)
            sys.exit(1)
    Registry(cfg.exp_dir).register("server", k, f"http://{net.advertised_host()}:{port}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)


def start_server_process(
    cmd: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Run a server command as a child that dies with this process, its output in log_path
    after a first line with the command (what `wait_for_server` reports)."""
    from areal.process import die_with_parent

    with open(log_path, "w") as log:
        log.write(COMMAND_PREFIX + shlex.join(cmd) + "\n")
        log.flush()
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent, env=env,
        )  # fmt: skip


def start_embedded_server(
    model: str | Path, log_path: Path, *args: str, api_key: str | None = None
) -> tuple[subprocess.Popen, str]:
    """The embedded server on a free loopback port, as a child that dies with this process
    (eval, benchmarks, tests); returns the process and its URL. Poll /health (or call
    `wait_for_server`) to know it is ready. With api_key it requires that key."""
    port = net.free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "areal.rollout.server", "--model", str(model)]
    cmd += ["--port", str(port), *args]
    env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
    return start_server_process(cmd, log_path, env), f"http://127.0.0.1:{port}"


class ServerStartError(RuntimeError):
    """An inference server did not become healthy; the message has its command and log tail."""


def server_log_path(exp_dir: Path, k: int) -> Path:
    """The log of inference server k in a run (the launcher names logs after steps)."""
    return Path(exp_dir) / "logs" / f"server{k}.log"


def read_command(log_path: Path) -> str | None:
    """The command line a server log starts with, if it does."""
    try:
        with open(log_path, errors="replace") as f:
            for _, line in zip(range(20), f, strict=False):
                if line.startswith(COMMAND_PREFIX):
                    return line[len(COMMAND_PREFIX) :].rstrip("\n")
    except OSError:
        pass
    return None


def explain_start_failure(
    reason: str, log_path: Path | None, command: str | None = None, lines: int = 30
) -> str:
    """reason, then the server's command line and the last `lines` of its log."""
    parts = [reason]
    if log_path is not None:
        command = command or read_command(log_path)
    parts.append(f"server command: {command or '(unknown: not in the log)'}")
    if log_path is not None:
        try:
            tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"last {len(tail)} lines of {log_path}:\n" + "\n".join(tail))
        except OSError as e:
            parts.append(f"no server log at {log_path}: {e}")
    return "\n".join(parts)


async def wait_for_server(
    client: InferenceClient,
    timeout: float,
    log_path: Path | None = None,
    proc: subprocess.Popen | None = None,
    command: list[str] | None = None,
) -> None:
    """Wait until client's server is healthy; ServerStartError with the server's command and
    log tail if it is not within `timeout` seconds or its process (when given) exits."""
    try:
        await client.wait_healthy(timeout, proc)
    except (RuntimeError, TimeoutError) as e:
        cmd = shlex.join(command) if command else None
        raise ServerStartError(explain_start_failure(str(e), log_path, cmd)) from None
