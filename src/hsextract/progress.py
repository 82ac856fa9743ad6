"""Progress bars for long loops: shown on a terminal only (tqdm disables itself when stderr is not a
TTY, e.g. a Snakemake job's log file), so logs and pipes get no bar noise."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(iterable: Iterable[T], *, desc: str, unit: str, total: int | None = None) -> Iterable[T]:
    """`iterable` wrapped in a tqdm bar on stderr, or plainly when stderr is not a terminal."""
    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, disable=None, leave=False,
                dynamic_ncols=True, mininterval=0.5)


class ProgressDataset:
    """A dataset whose iteration shows a bar; everything else is the dataset's own."""

    def __init__(self, ds: Any, desc: str) -> None:
        self._ds, self._desc = ds, desc

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> Any:
        return self._ds[i]

    def __iter__(self) -> Any:
        return iter(bar(self._ds, desc=self._desc, unit="sample", total=len(self._ds)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)
