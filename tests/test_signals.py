"""serving.signals: a SIGTERM that lands on another thread still stops the main thread's wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# another thread takes the signal: it was started before the main thread blocked SIGTERM, as the
# threads CUDA and torch start take it in the reranker process
SCRIPT = textwrap.dedent(
    """
    import signal, threading
    from serving.signals import sleep_until
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("waiting", flush=True)
    sleep_until(stop)
    print("stopped", flush=True)
    """
)


def test_a_sigterm_taken_by_another_thread_ends_the_wait() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert out.strip() == "stopped"
    assert proc.returncode == 0
