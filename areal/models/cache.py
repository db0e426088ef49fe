"""The tiny models, made once per machine: a cache keyed by everything that makes one.

    train.py --tiny_model(params)--> CACHE/tiny-longtail-h64-l2-w1500-s1-<key>/
                                       there: returned at once (nothing imported)
                                       missing: lock; warm up (progress bar, free cores);
                                                write NAME.tmpPID/; rename; unlock

CACHE is $AREAL_CACHE_DIR/models, else $XDG_CACHE_HOME/areal/models, else
~/.cache/areal/models: one per machine, not per fileroot, so every run of a config after the
first starts at once. The key hashes the model's parameters (task, sizes, warm-up steps, the
task's options, seed), the source of the files that make it (RECIPE_FILES, the task's own
module and the modules beside it), the versions of torch, transformers and tokenizers, and
the processor's floating-point path (cpu_numerics): a changed warm-up makes a new model,
never reuses a stale one, and a cache shared by machines of other processors holds one model
each (their kernels round differently, and 500 warm-up steps carry that into other weights).
The directory appears by rename, whole or not at all, and is made under a lock (NAME.lock):
a second run that wants the same model meanwhile waits for the first instead of making it
again beside it.

| waits for                      | unblocked by                                         |
|--------------------------------|------------------------------------------------------|
| the lock                       | the run making the same model finishing (or dying)   |
| the warm-up                    | its steps, on the cores other processes leave free   |
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from areal.config import ConfigError
from areal.cores import CoreMeter, node_cores

CACHE_ENV = "AREAL_CACHE_DIR"
"""Where areal caches what it makes (the tiny models under models/); tests point it at tmp."""
_ROOT = Path(__file__).resolve().parents[1]
RECIPE_FILES = (
    "models/tiny.py", "tasks/__init__.py", "tasks/arith.py", "workflow/openai_api.py",
)  # fmt: skip
"""The files (under areal/) whose code makes a tiny model: the model, tokenizer and warm-up
loop; the task seam; arith, whose sums train every tokenizer; the chat rendering of agent
episodes. With the task's own module (and those beside it) they are hashed into the key."""
_LIBRARIES = ("torch", "transformers", "tokenizers")
ADAPT_S = 2.0
"""Seconds between two measurements of the free cores (and changes of the threads)."""


def cache_dir() -> Path:
    """$AREAL_CACHE_DIR/models, else $XDG_CACHE_HOME/areal/models, else ~/.cache/areal/models."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "areal" / "models"


def cpu_numerics() -> str:
    """What decides how this machine's float32 kernels round, e.g. "x86_64/AuthenticAMD/AVX2".

    torch's ATen kernels take the widest vector ISA the processor has (AVX512 or AVX2, or
    ATEN_CPU_CAPABILITY's), and MKL's matrix products a path per vendor and ISA: sums then
    run in another order. A model warmed up on an AVX-512 Xeon and one warmed up on an AVX2
    EPYC differ from the first step's last bits on; the number of threads does not change
    them (the same weights on 1 and 2 cores). Read from /proc/cpuinfo: no torch import."""
    flags: set[str] = set()
    vendor = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        isa = "AVX512"
    elif "avx2" in flags:
        isa = "AVX2"
    else:
        isa = "DEFAULT"
    isa = os.environ.get("ATEN_CPU_CAPABILITY", isa).upper()
    return f"{platform.machine()}/{vendor}/{isa}"


def model_key(params: dict, task_file: str | None) -> str:
    """sha256 of the parameters, the recipe's source, the libraries' versions and the
    processor's floating-point path."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    h.update(f"cpu={cpu_numerics()}".encode())
    for rel in sorted(RECIPE_FILES):
        h.update(rel.encode() + b"\0" + (_ROOT / rel).read_bytes())
    if task_file:  # its module and the modules beside it (the warm-up data it imports)
        for path in sorted(Path(task_file).parent.glob("*.py")):
            h.update(b"task\0" + path.name.encode() + b"\0" + path.read_bytes())
    for lib in _LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            h.update(f"{lib}=={metadata.version(lib)}".encode())
    return h.hexdigest()


def tiny_model(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    warmup_steps: int = 200,
    task: str = "arith",
    options: dict | None = None,
    root: Path | None = None,
) -> Path:
    """The directory of the tiny model with these parameters (areal.models.tiny's) in
    `root` (default: cache_dir()), made first if it has none."""
    from areal.tasks import load_task

    warmup = load_task(task).warmup
    task_file = inspect.getsourcefile(warmup) if warmup is not None else None
    options = options or {}
    params = {"seed": seed, "hidden": hidden, "layers": layers, "heads": heads,
              "warmup_steps": warmup_steps, "task": task, "options": options}  # fmt: skip
    name = (  # a task "pkg.mod:TASK" makes the directory tiny-pkg.mod_TASK-...
        f"tiny-{re.sub(r'[^0-9A-Za-z_.-]', '_', task)}-h{hidden}-l{layers}"
        f"{f'-a{heads}' if heads != 4 else ''}-w{warmup_steps}"
        + "".join(f"-{k}{v}" for k, v in sorted(options.items()))
        + f"-s{seed}-{model_key(params, task_file)[:12]}"
    )
    path = (root or cache_dir()) / name
    if (path / "config.json").exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot make the tiny model's directory {path.parent} ({e}): set {CACHE_ENV} to a "
            "writable directory, or model.path to a model"
        ) from None
    with _locked(path.with_name(name + ".lock")):
        if (path / "config.json").exists():  # made by the run we waited for
            return path
        for stale in path.parent.glob(name + ".tmp*"):  # left by a run that died making it
            shutil.rmtree(stale, ignore_errors=True)
        from areal.models.tiny import make_tiny_model  # torch: only to make one

        print(f"areal: making the tiny model {path} (once)", flush=True)
        t0, cpu0 = time.monotonic(), time.process_time()
        progress = WarmupProgress(warmup_steps)
        try:
            make_tiny_model(path, **params, on_step=progress.step)
        finally:
            progress.close()
        print(
            f"areal: made the tiny model in {_duration(time.monotonic() - t0)} "
            f"({warmup_steps} warm-up steps on {progress.mean_threads():.1f} threads, "
            f"{time.process_time() - cpu0:.0f} CPU-seconds)",
            flush=True,
        )
    return path


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Holds an exclusive flock on `lock` (released by the kernel if this process dies)."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"areal: waiting for another process making {lock.with_suffix('')}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class WarmupProgress:
    """Called before each warm-up step: every ADAPT_S, sets torch's threads to the cores
    other processes leave free (CoreMeter: never more, at least one; nothing else of the run
    computes yet, so the node's cores are its share), and shows the steps done and the time
    left: a progress bar on a terminal, else a line every tenth of the steps."""

    def __init__(self, total: int) -> None:
        import torch
        from tqdm import tqdm

        self.total = total
        self.share = node_cores()
        self.meter = CoreMeter()
        self.threads = torch.get_num_threads()
        self._set_threads = torch.set_num_threads
        self._t0 = self._adapted = time.monotonic()
        self._thread_s = 0.0
        self._tty = sys.stdout.isatty()
        self._next_line = 0
        self.bar = tqdm(
            total=total, desc="areal: tiny model warm-up", unit="step", file=sys.stdout,
            dynamic_ncols=True, disable=not self._tty or total <= 0,
        )  # fmt: skip

    def step(self, done: int) -> None:
        """Before step `done` (0-based): adapt the threads, show the progress."""
        now = time.monotonic()
        if done == 0 or now - self._adapted >= ADAPT_S:
            self._thread_s += self.threads * (now - self._adapted)
            self._adapted = now
            threads = self.meter.threads(self.share)
            if threads != self.threads:
                self._set_threads(threads)
                self.threads = threads
        if self._tty:
            plural = "s" * (self.threads > 1)
            self.bar.set_postfix_str(f"{self.threads} thread{plural}", refresh=False)
            self.bar.update(done - self.bar.n)
        elif done >= self._next_line and done > 0:
            elapsed = now - self._t0
            left = elapsed / done * (self.total - done)
            print(
                f"areal: tiny model warm-up {done}/{self.total} steps, {_duration(elapsed)}, "
                f"ETA {_duration(left)}, {self.threads} thread{'s' * (self.threads > 1)}",
                flush=True,
            )
        if done >= self._next_line:
            self._next_line = done + max(1, self.total // 10)

    def mean_threads(self) -> float:
        now = time.monotonic()
        seconds = now - self._t0
        return (self._thread_s + self.threads * (now - self._adapted)) / seconds if seconds else 1

    def close(self) -> None:
        if self._tty:
            self.bar.update(self.total - self.bar.n)
        self.bar.close()


def _duration(seconds: float) -> str:
    from areal.launcher.progress import format_duration

    return format_duration(seconds)
