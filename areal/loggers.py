"""Metric loggers: the scalars of metrics.jsonl, again, in TensorBoard and Weights & Biases.

    trainer rank 0 --one line per step--> metrics.jsonl (the source of truth)
    launcher (Progress tails it) --record--> MetricSink queue --thread--> TensorBoard files
                                                                       '-> W&B (if configured)

The loggers run in the launcher, on a thread of their own: a slow or failing logger (no
network, a bad key, a full disk) can delay neither training nor the launcher's watch over
the roles. A logger that fails warns once and is dropped; the run goes on.

Every launch rebuilds {exp_dir}/tensorboard/ from metrics.jsonl (the launcher reads it from
the top, resumed runs included), so the TensorBoard scalars always equal the file's. A
resumed run is a new W&B run that replays the history first.
"""

from __future__ import annotations

import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from areal.config import ExperimentConfig

TENSORBOARD_DIR = "tensorboard"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers a logger plots for one metrics.jsonl line (all but the step itself)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class MetricLogger(Protocol):
    name: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Event files readable by TensorBoard, written with tensorboard's own writer (no torch,
    no TensorFlow: the launcher stays light)."""

    name = "TensorBoard"

    def __init__(self, log_dir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        shutil.rmtree(log_dir, ignore_errors=True)  # rebuilt from metrics.jsonl every launch
        self._writer = EventFileWriter(str(log_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(
            value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    name = "W&B"

    def __init__(self, cfg: ExperimentConfig):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "stats.wandb.mode is set but wandb is not installed: `pip install wandb`, "
                "or set stats.wandb.mode=disabled"
            ) from None
        w = cfg.stats.wandb
        self._run = wandb.init(
            mode=w.mode,
            project=w.project or cfg.experiment_name,
            name=w.name or cfg.trial_name,
            entity=w.entity or None,
            dir=str(cfg.exp_dir),  # offline runs land in {exp_dir}/wandb/offline-run-*
            config=_config_dict(cfg),
            # No console capture: the launcher's stdout is the user's terminal.
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def _config_dict(cfg: ExperimentConfig) -> dict:
    from areal.config import to_dict

    return to_dict(cfg)


def make_loggers(cfg: ExperimentConfig) -> list[tuple[str, Callable[[], MetricLogger]]]:
    """(name, factory) of each logger the config asks for; the sink's thread builds them."""
    factories = [("TensorBoard", lambda: TensorBoardLogger(cfg.exp_dir / TENSORBOARD_DIR))]
    if cfg.stats.wandb.mode != "disabled":
        factories.append(("W&B", lambda: WandbLogger(cfg)))
    return factories


class MetricSink:
    """Feeds metrics.jsonl records to the loggers on a background thread."""

    _STOP = object()

    def __init__(
        self, factories: list[tuple[str, Callable[[], MetricLogger]]], close_timeout_s: float = 60.0
    ):
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(factories,), name="metric-loggers", daemon=True
        )
        self._thread.start()

    def log(self, record: dict[str, Any]) -> None:
        self._queue.put(record)

    def close(self) -> None:
        """Flush what is queued and close the loggers (waits up to close_timeout_s)."""
        self._queue.put(self._STOP)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            _warn(f"the metric loggers did not finish within {self.close_timeout_s:g}s")

    def _run(self, factories: list[tuple[str, Callable[[], MetricLogger]]]) -> None:
        loggers = []
        for name, factory in factories:
            try:
                loggers.append(factory())
            except Exception as e:  # any failure: this logger is off, the run goes on
                _warn(f"{name} logging could not start ({type(e).__name__}: {e}); "
                      "the run goes on without it")  # fmt: skip
        while True:
            record = self._queue.get()
            if record is self._STOP:
                break
            if not isinstance(record.get("step"), int):
                continue
            values = scalars(record)
            for logger in list(loggers):
                try:
                    logger.log(record["step"], values)
                except Exception as e:
                    _warn(f"{logger.name} logging failed ({type(e).__name__}: {e}); "
                          "the run goes on without it")  # fmt: skip
                    loggers.remove(logger)
        for logger in loggers:
            try:
                logger.close()
            except Exception as e:
                _warn(f"{logger.name} failed to close ({type(e).__name__}: {e})")


def _warn(message: str) -> None:
    print(f"\nareal: warning: {message}", file=sys.stderr, flush=True)
