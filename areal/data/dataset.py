"""Prompts for the rollout controller: rows {"prompt", "answer", "task"} -> token ids."""

from __future__ import annotations

import logging

from areal.data import arith, longtail

log = logging.getLogger("areal.data")


SYNTHETIC = ("arith", "longtail")  # tasks made in code, no file


def synthetic_rows(task: str, n: int, max_operand: int, seed: int) -> list[dict]:
    """n rows of a task in SYNTHETIC (max_operand: arith only)."""
    if task == "arith":
        return arith.make_problems(n, max_operand, seed)
    return longtail.make_problems(n, seed)


def load_rows(dataset_cfg, seed: int) -> list[dict]:
    """Rows {"prompt", "answer", "task"}: generated (SYNTHETIC) or read from dataset.path."""
    if dataset_cfg.type in SYNTHETIC:
        return synthetic_rows(
            dataset_cfg.type, dataset_cfg.n_problems, dataset_cfg.max_operand, seed
        )
    from areal.data.problems import load_file_rows

    return load_file_rows(dataset_cfg.type, dataset_cfg.path)


def tokenize_rows(rows: list[dict], tokenizer, max_prompt_len: int) -> list[dict]:
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
