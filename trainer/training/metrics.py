"""Validation metrics of the drafter trainers: sums over an epoch, and the console table they end in.

A validation step adds its batch's sums (per depth, per unrolled step, per (block, slot): any shape, the same
every batch); the epoch's means are the sums divided by a count that was summed alongside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from rich.console import Console
from rich.table import Table


class MetricSums:
    """Named sums over one validation epoch, detached and on the CPU."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, sums: Mapping[str, torch.Tensor]) -> None:
        for key, value in sums.items():
            value = value.detach().cpu()
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def clear(self) -> None:
        self.sums = {}

    def __bool__(self) -> bool:
        return bool(self.sums)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.sums[key]

    def mean(self, stat: str, count: str) -> torch.Tensor:
        """``stat`` per counted item; 0 where ``count`` is 0."""
        return self.sums[stat] / self.sums[count].clamp(min=1)


def show_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """Print a table of already formatted cells on the console."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
