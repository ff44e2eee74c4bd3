"""The main thread waiting for a stop that a signal handler sets."""

from __future__ import annotations

import threading

WAKE_S = 0.5  # how late a stop can be noticed


def sleep_until(stop: threading.Event) -> None:
    """Block until ``stop`` is set, waking every :data:`WAKE_S`.

    Python runs a signal's handler in the main thread, at its next bytecode; the kernel may deliver
    a process's SIGTERM to any thread that does not block it, and a main thread asleep in a plain
    ``Event.wait()`` wakes only when the signal lands on it. In a process full of CUDA's and
    torch's threads it landed elsewhere: the reranker process slept through SIGTERM on an H100
    until its supervisor killed it (docs/gpu.md)."""
    while not stop.wait(WAKE_S):
        pass
