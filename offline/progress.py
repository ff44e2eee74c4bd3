"""Progress of long work, shaped for where it goes.

On a terminal: a tqdm bar. Anywhere else (a log file, CI, a service's journal): a few log lines
(start, every quarter, end with the rate) instead of one line per tick.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("hybrid_search.progress")
_QUARTERS = (0.25, 0.5, 0.75)
EVERY_S = 60.0  # long work says how far it got at least this often
Observer = Callable[[str, int, "int | None"], None]  # (what, done, total) after each item
_observer: ContextVar[Observer | None] = ContextVar("progress_observer", default=None)


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[None]:
    """Every :class:`track` run in this context (this thread) also tells ``observer`` how far it
    got, shown or not: a build run by a server reports its progress there (``GET /jobs/{id}``)."""
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


class track(Generic[T]):  # noqa: N801 - used like a function, as tqdm is
    """Iterate ``items`` with progress; ``note(loss=...)`` adds figures to what is shown next.
    Silent when not ``enabled``."""

    def __init__(
        self, items: Iterable[T], desc: str, unit: str = "item", total: int | None = None, enabled: bool = True
    ) -> None:
        self.items, self.desc, self.unit, self.enabled = items, desc, unit, enabled
        self.units = _plural(unit)
        self.total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
        self._bar = None
        self._notes: dict[str, str] = {}

    def note(self, **values: object) -> None:
        self._notes.update({k: str(v) for k, v in values.items()})
        if self._bar is not None:
            self._bar.set_postfix(self._notes)

    def __iter__(self) -> Iterator[T]:
        observer = _observer.get()
        items = self.items if observer is None else self._observed(observer)
        if not self.enabled:
            yield from items
        elif sys.stderr.isatty():
            from tqdm import tqdm

            with tqdm(items, desc=self.desc, unit=self.unit, total=self.total) as self._bar:
                yield from self._bar
        else:
            yield from self._logged(items)

    def _observed(self, observer: Observer) -> Iterator[T]:
        observer(self.desc, 0, self.total)
        for done, item in enumerate(self.items, 1):
            yield item
            observer(self.desc, done, self.total)

    def _logged(self, items: Iterable[T]) -> Iterator[T]:
        """A line at the start, at each quarter and at least every :data:`EVERY_S` seconds (with the
        rate and the time left), and at the end."""
        started, total = time.perf_counter(), self.total
        marks = sorted({int(q * total) for q in _QUARTERS} - {0}) if total else []
        log.info("%s: started%s", self.desc, f" ({total:,} {self.units})" if total else "")
        done, last = 0, started
        for item in items:
            yield item
            done += 1
            now = time.perf_counter()
            quarter = bool(marks) and done == marks[0]
            if quarter:
                marks.pop(0)
            if (quarter or now - last >= EVERY_S) and total:
                last = now
                rate = done / (now - started)
                log.info(
                    "%s: %d%% (%s/%s %s), %s/s, about %s left%s",
                    self.desc,
                    int(100 * done / total),
                    f"{done:,}",
                    f"{total:,}",
                    self.units,
                    f"{rate:,.2f}" if rate < 10 else f"{rate:,.0f}",
                    _duration((total - done) / rate) if rate > 0 else "?",
                    self._suffix(),
                )
        seconds = time.perf_counter() - started
        rate = f", {done / seconds:,.1f} {self.units}/s" if seconds > 0 else ""
        log.info("%s: done, %s %s in %.1f s%s%s", self.desc, f"{done:,}", self.units, seconds, rate, self._suffix())

    def _suffix(self) -> str:
        return "".join(f", {k} {v}" for k, v in self._notes.items())


def _plural(unit: str) -> str:
    if unit.endswith("y") and unit[-2:-1] not in tuple("aeiou"):
        return unit[:-1] + "ies"
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
