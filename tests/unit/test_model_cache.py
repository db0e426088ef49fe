"""The tiny models' cache (areal/models/cache.py): where it is, what its key covers, one
model made once even by two processes at a time, and the warm-up's progress and threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal.cores import CoreMeter
from areal.models import cache
from areal.models.cache import CACHE_ENV, cache_dir, model_key, tiny_model

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"seed": 1, "hidden": 64, "layers": 2, "heads": 4, "warmup_steps": 20,
          "options": {"max_operand": 5}, "task": "arith"}  # fmt: skip


def test_the_cache_is_per_machine_and_can_be_moved(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache/areal/models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg/areal/models"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine/models"


def test_the_key_covers_parameters_and_the_recipe(monkeypatch, tmp_path):
    key = model_key(PARAMS, None)
    assert key == model_key(dict(reversed(PARAMS.items())), None)
    assert key != model_key({**PARAMS, "seed": 2}, None)
    # A changed warm-up (any recipe file, or the task's own module) is another model.
    task = tmp_path / "task.py"
    task.write_text("x = 1\n")
    with_task = model_key(PARAMS, str(task))
    task.write_text("x = 2\n")
    changed_task = model_key(PARAMS, str(task))
    (tmp_path / "warmup_data.py").write_text("PROMPTS = []\n")  # a module the task imports
    assert len({key, with_task, changed_task, model_key(PARAMS, str(task))}) == 4
    copy = tmp_path / "areal"
    for rel in cache.RECIPE_FILES:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((cache._ROOT / rel).read_bytes())
    monkeypatch.setattr(cache, "_ROOT", copy)
    assert model_key(PARAMS, None) == key
    with open(copy / "models/tiny.py", "a") as f:
        f.write("# another warm-up\n")
    assert model_key(PARAMS, None) != key


def test_the_key_names_the_processors_float_path(monkeypatch):
    """Kernels of another ISA or vendor round otherwise, and the warm-up carries that into
    every weight (issue 60): such a machine's model is another model, under another key."""
    assert cache.cpu_numerics().count("/") == 2  # machine/vendor/ISA
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert cache.cpu_numerics().endswith("/AVX512")
    wide = model_key(PARAMS, None)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert model_key(PARAMS, None) != wide


def test_a_model_is_made_once_with_progress_then_taken_from_the_cache(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = tiny_model(**PARAMS)
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny-arith-h64-l2-w20")
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    out = capsys.readouterr().out
    # No terminal here: a line every tenth of the steps, with the time left.
    assert "tiny model warm-up 2/20 steps" in out and "ETA" in out
    assert "made the tiny model in" in out
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp" in p.name] == []

    def fail(*args, **kwargs):
        raise AssertionError("made again")

    monkeypatch.setattr("areal.models.tiny.make_tiny_model", fail)
    assert tiny_model(**PARAMS) == path
    assert capsys.readouterr().out == ""


def test_two_processes_wanting_one_model_make_it_once(tmp_path):
    script = textwrap.dedent(f"""
        from areal.models.cache import tiny_model
        print("PATH", tiny_model(**{PARAMS | {"warmup_steps": 40}!r}))
    """)
    env = {**os.environ, CACHE_ENV: str(tmp_path), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    text = "".join(out for out, _ in outs)
    assert text.count("made the tiny model in") == 1, text
    paths = {line.split()[1] for line in text.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1 and (Path(paths.pop()) / "config.json").exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp" in p.name] == []


def _stat(path: Path, busy: int, idle: int) -> None:
    """A /proc/stat of two CPUs, each with `busy` and `idle` ticks so far."""
    cpus = "".join(f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0\n" for i in range(2))
    path.write_text(f"cpu {2 * busy} 0 0 {2 * idle} 0 0 0 0 0 0\n{cpus}")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux: CPU affinity")
def test_the_warm_up_takes_the_cores_others_leave_free(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("time.process_time", lambda: 0.0)  # this process computes nothing
    stat = tmp_path / "stat"
    _stat(stat, 100, 100)
    meter = CoreMeter(str(stat))
    _stat(stat, 1100, 100)  # both CPUs busy with other processes' work
    assert meter.threads(2) == 1
    _stat(stat, 1600, 600)  # half busy: one core free
    assert meter.threads(2) == 1
    _stat(stat, 1600, 1600)  # idle
    assert meter.threads(2) == 2 and meter.threads(1) == 1
