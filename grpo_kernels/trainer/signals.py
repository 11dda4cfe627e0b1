"""Ctrl-C and SIGTERM stop a run at the next step boundary, where the trainer writes a checkpoint, instead of in the
middle of a step: the steps since the last periodic checkpoint are kept. A second Ctrl-C stops at once (the last
checkpoint written stays the latest); a repeated SIGTERM (a supervisor's, or a parent-death signal) changes nothing."""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopAtStepBoundary:
    """While active (a `with` block in the main thread), SIGINT and SIGTERM are recorded in `requested` rather
    than raised; a signal the process ignores (SIG_IGN) stays ignored. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.requested: int | None = None  # the signal received, if any
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                if signal.getsignal(number) is not signal.SIG_IGN:
                    self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.requested).name if self.requested is not None else ""

    def _record(self, number: int, frame: FrameType | None) -> None:
        if self.requested is not None and number == signal.SIGINT:  # Ctrl-C twice: stop now
            raise KeyboardInterrupt(f"{signal.Signals(number).name} again: stopped inside a step")
        self.requested = number
