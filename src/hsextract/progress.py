"""Progress of long work (prepare, extract, validate, export): a tqdm bar on a terminal; in a log or a pipe (a
Snakemake job's log file, nohup, CI) plain lines instead, one at most every LOG_EVERY_S with the count, rate, time
taken and time left, and a last one at the end of work that wrote any. No carriage returns, nothing for short work."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LOG_EVERY_S = 30.0


class LogProgress:
    """Progress as lines on stderr (tqdm's `update` and `close`)."""

    def __init__(self, total: int | None, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.lines = self.shown = 0  # shown: the count the last line said
        self.start = self.last = time.monotonic()

    def update(self, k: int = 1) -> None:
        self.n += k
        if time.monotonic() - self.last >= LOG_EVERY_S:
            self._line()

    def close(self) -> None:
        """The end, where lines were written; never for work stopped short (an error: no rate or time left is
        claimed for a job that is gone)."""
        if self.lines and (self.total is None or self.n >= self.total) and self.n != self.shown:
            self._line()

    def _line(self) -> None:
        self.last = now = time.monotonic()
        self.lines, self.shown = self.lines + 1, self.n
        took = now - self.start
        rate = self.n / took if took > 0 else 0.0
        count = f"{self.n:,}"
        if self.total:
            count += f"/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            count += f" {self.unit}"
        left = f", {tqdm.format_interval((self.total - self.n) / rate)} left" if self.total and rate else ""
        print(f"{self.desc}: {count}, {tqdm.format_sizeof(rate)} {self.unit}/s, {tqdm.format_interval(took)} taken"
              f"{left}", file=sys.stderr, flush=True)


def counter(total: int | None, *, desc: str, unit: str, enabled: bool = True, scale: bool = True,
            leave: bool = True) -> Any:
    """An object whose update(k) counts work done and close() ends it: a bar on a terminal (`scale`: counts as
    2.5k; `leave`: kept when done), lines elsewhere."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, unit=unit, unit_scale=scale, desc=desc, file=sys.stderr, leave=leave,
                    dynamic_ncols=True, mininterval=0.5)
    return LogProgress(total, desc, unit)


def bar(iterable: Iterable[T], *, desc: str, unit: str, total: int | None = None) -> Iterator[T]:
    """`iterable`, its progress shown (counter; a bar cleared when done)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    c = counter(total, desc=desc, unit=unit, scale=False, leave=False)
    for x in iterable:
        yield x
        c.update()
    c.close()  # not reached where the loop stopped short


def quiet_library_bars() -> None:
    """Off a terminal, transformers' own bars (loading weights) would write carriage returns into the log: turned
    off there, for the whole process (transformers' setting is global: a job script's call, never a library's)."""
    if sys.stderr.isatty():
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # not installed: no bar of its own
        return
    hf_logging.disable_progress_bar()


class ProgressDataset:
    """A dataset whose iteration shows its progress; everything else is the dataset's own."""

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
