"""What every vgpu process does with signals: the first SIGTERM/SIGINT asks
for an orderly shutdown, a second one exits at once."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType


def stop_on_signals(
    stop: threading.Event, log: logging.Logger, signalled: threading.Event | None = None
) -> None:
    """Set `stop` (and `signalled`, when given) on the first SIGTERM/SIGINT;
    exit 1 at once on the second."""
    count = {"signals": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        count["signals"] += 1
        if count["signals"] > 1:
            log.error("second signal: exiting now")
            os._exit(1)
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()
        if signalled is not None:
            signalled.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
