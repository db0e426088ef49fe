"""The cells a decode step of the embedded engine reads: its attention chunks.

A step attends each row to its cached tokens and the new one. Rows are read in chunks of
neighbouring rows, each chunk up to its own longest row, so a step reads rows x longest where
one long row sits among short ones. Torch-free, so that the planner
(areal/planner/sim_servers.py) costs its simulated steps by the rule KVCache.decode runs.
"""

from __future__ import annotations

from collections.abc import Sequence

CHUNK_ROWS = 16
"""Rows per attention chunk of a decode step."""


def attention_chunks(
    lens: Sequence[int], chunk_rows: int = CHUNK_ROWS
) -> list[tuple[int, int, int]]:
    """(first row, end row, width) of each chunk for rows holding `lens` cached tokens.
    Chunks of chunk_rows rows are taken only when they read at most 3/4 of what one chunk
    over every row reads: each chunk costs a few more kernel calls."""
    n = len(lens)
    whole = [(0, n, max(lens) + 1)]
    if n < 2 * chunk_rows:
        return whole
    parts = [
        (a, min(a + chunk_rows, n), max(lens[a : a + chunk_rows]) + 1)
        for a in range(0, n, chunk_rows)
    ]
    return parts if 4 * cells_read(parts) <= 3 * n * whole[0][2] else whole


def cells_read(chunks: list[tuple[int, int, int]]) -> int:
    """Cells a step over these chunks reads (rows x width, summed)."""
    return sum((b - a) * width for a, b, width in chunks)
