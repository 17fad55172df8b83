"""Logging for every command: one line format, the rank in training jobs, progress lines in batch logs.

What a command exists to produce (the JSON summary of prepare, convert and export, the `status` table)
is printed to stdout; everything else is logged to stderr, one line per record:

    2025-06-01T12:00:00Z INFO [rank 3/64] (step 10) step_loss : 2.1234 learning_rate : 1.50e-04 ...

The rank (RANK/WORLD_SIZE, set by torchrun) is in every line of a training job. The level of the
`training` loggers is INFO, or the environment variable TRAINING_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR);
other libraries' loggers keep their own level. Long steps report through `Progress`: a tqdm bar on a
terminal, a log line every 30 s and one at the end elsewhere (Slurm logs, pipes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

from training.errors import UserError

LEVEL_VARIABLE = "TRAINING_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PROGRESS_INTERVAL = 30.0  # seconds between progress lines when stderr is not a terminal

log = logging.getLogger("training")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record is emitted (pytest's capture swaps it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def rank_label(environ: Mapping[str, str] = os.environ, *, training: bool = False) -> str:
    """'[rank 3/64] ' under torchrun; '[rank 0/1] ' for a training job without it; '' otherwise."""
    if "RANK" not in environ and not training:
        return ""
    return f"[rank {environ.get('RANK', '0')}/{environ.get('WORLD_SIZE', '1')}] "


def setup_logging(*, training: bool = False, environ: Mapping[str, str] = os.environ) -> None:
    """Configure the `training` loggers for one command; calling it again replaces the previous set-up."""
    level = environ.get(LEVEL_VARIABLE, "").strip().upper() or "INFO"
    if level not in LEVELS:
        raise UserError(f"{LEVEL_VARIABLE}: {environ[LEVEL_VARIABLE]!r} is not allowed; allowed: {', '.join(LEVELS)}")
    formatter = logging.Formatter(
        f"%(asctime)s %(levelname)s {rank_label(environ, training=training)}%(message)s", datefmt="%Y-%m-%dT%H:%M:%SZ"
    )
    formatter.converter = time.gmtime
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(formatter)
    # On the root logger, so a library's later `logging.basicConfig()` (torch-xla calls it on import) finds a
    # handler and adds none: otherwise every line would be printed twice. The `training` loggers propagate.
    root = logging.getLogger()
    for previous in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(previous)
    root.addHandler(handler)
    # Other libraries at Python's default, WARNING, whatever ran before in the process set (an AWS Lambda handler
    # sets the root to INFO): their INFO lines, such as every HTTP request of the Hub client, are not ours.
    root.setLevel(logging.WARNING)
    log.setLevel(level)
    log.propagate = True


def human(value: float) -> str:
    """1234567 -> '1.2 M' (decimal units)."""
    for factor, suffix in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f} {suffix}"
    return f"{value:g}"


class Progress:
    """Progress of a long step: a tqdm bar on a terminal, else a log line every `interval` s and at the end.

    `update(n, tokens=...)` counts `n` units and, optionally, other quantities shown beside them:
    `tokenizing: 12,345 docs, 1.2 M tokens, 0:01:10`. Not thread-safe: callers from threads hold a lock.
    On an exception, or with nothing counted, the final line is left out, so a failed command's stderr is
    its one `error:` line unless it ran for longer than `interval`.
    """

    def __init__(
        self,
        description: str,
        unit: str,
        *,
        total: int | None = None,
        interval: float = PROGRESS_INTERVAL,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.description, self.unit, self.total, self.interval = description, unit, total, interval
        self.count = 0
        self.extras: dict[str, int] = {}
        self._clock, self._logger = clock, logger or log
        self._started = clock()
        self._next = self._started + interval
        self._bar: Any = None
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit=f" {unit}")

    def update(self, n: int = 1, **extras: int) -> None:
        self.count += n
        for name, value in extras.items():
            self.extras[name] = self.extras.get(name, 0) + int(value)
        if self._bar is not None:
            if self.extras:
                self._bar.set_postfix_str(self._extras_text(), refresh=False)
            self._bar.update(n)
            return
        now = self._clock()
        if now >= self._next:
            self._logger.info(self.line(now))
            self._next = now + self.interval

    def line(self, now: float | None = None) -> str:
        elapsed = timedelta(seconds=int((self._clock() if now is None else now) - self._started))
        count = f"{self.count:,}" + (f"/{self.total:,}" if self.total is not None else "")
        extras = f", {self._extras_text()}" if self.extras else ""
        return f"{self.description}: {count} {self.unit}{extras}, {elapsed}"

    def _extras_text(self) -> str:
        return ", ".join(f"{human(value)} {name.replace('_', ' ')}" for name, value in self.extras.items())

    def close(self) -> None:
        """The final line (none when nothing was counted: an empty input gets its one error line), or the bar."""
        if self._bar is not None:
            self._bar.close()
        elif self.count:
            self._logger.info(self.line())

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        elif self._bar is not None:
            self._bar.close()
