"""Progress bars for the library's long loops: a widget in Jupyter, plain lines when headless.

    from .progress import tqdm
    for batch in tqdm(batches, desc="extract"): ...

`eagle3 run` executes the notebooks headless and streams the kernel's stderr to the terminal
(runner.py). There a widget bar would show nothing, and a text bar redrawn every 0.1 s would
flood the log, so with EAGLE3_PROGRESS=text (set by the runner for its kernels) bars are text,
one line per update, at most one update every EAGLE3_PROGRESS_SECONDS (default 30) per bar.
"""
from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm as _auto_tqdm
from tqdm.std import tqdm as _text_tqdm

PROGRESS_ENV = "EAGLE3_PROGRESS"
INTERVAL_ENV = "EAGLE3_PROGRESS_SECONDS"


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into separate lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        for line in s.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def text_mode() -> bool:
    return os.environ.get(PROGRESS_ENV) == "text"


def tqdm(*args, **kwargs):
    """tqdm.auto's bar, or a line-per-update text bar on stderr under the headless runner."""
    if not text_mode():
        return _auto_tqdm(*args, **kwargs)
    interval = float(os.environ.get(INTERVAL_ENV, "30"))
    kwargs.setdefault("mininterval", interval)
    kwargs.setdefault("maxinterval", max(interval, 10.0))
    kwargs.update(file=_Lines(sys.stderr), ascii=True, ncols=100, dynamic_ncols=False)
    return _text_tqdm(*args, **kwargs)


def relay(line: str) -> None:
    """Show a progress line of a subprocess (vLLM runs in one): on stderr under the headless runner,
    which streams only the kernel's stderr to the terminal, else on stdout."""
    print(line.rstrip(), file=sys.stderr if text_mode() else sys.stdout, flush=True)
