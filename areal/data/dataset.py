"""Prompts for the rollout controller: the task's rows {"prompt", "answer", "task"} -> ids.

    dataset.type --load_task--> Task --generate(dataset_cfg, seed)------------+--> rows
                                    '--from_record(each record of dataset.path)-'
    rows --chat template, dataset.max_prompt_len--> rows + "prompt_ids"

A malformed record of a file is logged with its file and line, skipped and counted; a file
without one usable record is a `ConfigError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal.config import ConfigError, DatasetConfig
from areal.data.files import BadRecord, read_records
from areal.tasks import Task, load_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("areal.data")

_LOGGED = 10  # malformed rows logged one by one at most; the rest only counted


def load_rows(dataset_cfg: DatasetConfig, seed: int) -> list[dict]:
    """The rows of dataset.type's task, each tagged with it ("task")."""
    return task_rows(load_task(dataset_cfg.type), dataset_cfg.type, dataset_cfg, seed)


def task_rows(task: Task, spec: str, dataset_cfg: DatasetConfig, seed: int) -> list[dict]:
    """The rows of `task` (made in code, or read from dataset.path), each tagged "task":
    spec, the name the reward service grades them under (areal.build passes a Task object
    and its name)."""
    task.options_of(dataset_cfg.options)  # a task of the user's: its options checked here
    if task.needs_path:
        if not dataset_cfg.path:
            raise ConfigError(
                f"dataset.path is required when dataset.type is {spec!r}: set it to the "
                "dataset file"
            )
        rows = file_rows(dataset_cfg.path, task.from_record, task.name, task.record_fields)
    else:
        rows = task.generate(dataset_cfg, seed)
    return [{**row, "task": spec} for row in rows]


def file_rows(
    path: str, from_record: Callable[[dict], dict], what: str, needs: str = ""
) -> list[dict]:
    """Rows of every usable record of a file (or a directory of files); see the module doc."""
    rows, skipped = [], 0
    for where, record in read_records(path):
        try:
            if isinstance(record, BadRecord):
                raise ValueError(record)
            if not isinstance(record, dict):
                raise ValueError(f"a record must be an object, got {type(record).__name__}")
            rows.append(from_record(record))
        except ValueError as e:
            skipped += 1
            if skipped <= _LOGGED:
                log.warning("%s: skipped a malformed %s row: %s", where, what, e)
    if skipped:
        log.warning("%s: skipped %d malformed rows, kept %d", path, skipped, len(rows))
    if not rows:
        raise ConfigError(
            f"dataset.path={path!r} has no usable {what} row ({skipped} malformed): each row "
            + (f"needs {needs}, " if needs else "")
            + "or set dataset.type to the file's task"
        )
    return rows


def tokenize_rows(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase, max_prompt_len: int
) -> list[dict]:
    """Adds "prompt_ids" (chat template applied); drops prompts over max_prompt_len."""
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        if len(ids) <= max_prompt_len:
            out.append({**row, "prompt_ids": list(ids)})
    if len(out) < len(rows):
        log.warning(
            "dropped %d prompts longer than dataset.max_prompt_len=%d",
            len(rows) - len(out),
            max_prompt_len,
        )
    if not out:
        raise ValueError(f"no prompt fits dataset.max_prompt_len={max_prompt_len}: raise it")
    return out
