"""Draws from the dataset: which row a new group generates from, each draw used once.

    dataset rows --seeded shuffle per epoch--> draw 0, 1, 2, ... (row + "draw_id")
         given back (its group failed) --> drawn again first, with the same draw id
         out (its group generating) --> used (buffered or declined) | given back

A draw's id counts the rows taken over all epochs; the same prompt generated again keeps
it, so a resumed or recovered run can show that it trained each draw exactly once. At a
checkpoint the draws out are saved with the given-back ones: their groups, lost with the
process, are generated again first.
"""

from __future__ import annotations

import random


class Draws:
    def __init__(self, rows: list[dict], seed: int):
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        """Rows of the current epoch taken so far."""
        self.retry: list[dict] = []
        """Draws given back, drawn again before any new one (the checkpoint's "retry")."""
        self.out: dict[int, dict] = {}
        """Draws whose group is generating, by draw id."""
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next(self) -> dict:
        """The row the next group generates from, with its "draw_id"; it is out until
        used or given back."""
        if self.retry:
            row = self.retry.pop(0)
        else:
            draw_id = self.epoch * len(self.rows) + self.pos
            row = {**self.rows[self._order[self.pos]], "draw_id": draw_id}
            self.pos += 1
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        assert row["draw_id"] not in self.out, "a draw is out twice"
        self.out[row["draw_id"]] = row
        return row

    def row(self, draw_id: int) -> dict:
        """The row of draw `draw_id`, as next() gave it (each epoch's order is seeded)."""
        epoch, pos = divmod(draw_id, len(self.rows))
        order = self._order if epoch == self.epoch else self._epoch_order(epoch)
        return {**self.rows[order[pos]], "draw_id": draw_id}

    def used(self, row: dict) -> None:
        """Its group is in the buffer, or its episode declined it: never drawn again."""
        del self.out[row["draw_id"]]

    def give_back(self, row: dict) -> None:
        """Its group failed: the row is drawn again, before any new one."""
        del self.out[row["draw_id"]]
        self.retry.append(row)

    def state_dict(self) -> dict:
        """The dataset position; draws out come back as given back (their groups are lost)."""
        return {"epoch": self.epoch, "pos": self.pos, "retry": [*self.out.values(), *self.retry]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._epoch_order(self.epoch)
        self.retry = list(state["retry"])
        self.out = {}
