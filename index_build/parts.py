"""A build in parts, and the folder that keeps what is finished so that a stopped build resumes.

The corpus is cut into parts of whole documents, ``--part-chunks`` chunks or a little more each,
in corpus order (:func:`plan_parts`), so rows, vectors and store writes follow the same order as a
build in one go, and a corpus below one part (NFCorpus) is built exactly as before. The work folder
``.<index name>.building`` beside the target holds ``build.json`` (the inputs that make the build
what it is, and the phases and parts done), ``vectors.npy`` (every chunk's vector, a part written at
a time: a part counts as done only once written and flushed), and ``index/``, the index being made,
which is renamed over the target at the end. Run the same command after a crash, a kill -9 or a
failure and it goes on from the last finished part; other inputs (another corpus, encoder or
vectors file) start afresh. A lock keeps two builds of one target apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
STATE_FILE = "build.json"
VECTORS_FILE = "vectors.npy"


@dataclass(frozen=True)
class Part:
    number: int
    docs: slice  # the documents of the corpus's list in this part
    rows: range  # their chunks' rows (the store's rows and the dense index's ids)


def plan_parts(chunk_counts: Sequence[int], size: int) -> list[Part]:
    """Whole documents in order (``chunk_counts``: each one's chunks), a new part once the current
    one holds ``size`` chunks."""
    parts: list[Part] = []
    first_doc = first_row = row = 0
    for i, count in enumerate(chunk_counts):
        row += count
        if row - first_row >= size:
            parts.append(Part(len(parts), slice(first_doc, i + 1), range(first_row, row)))
            first_doc, first_row = i + 1, row
    if first_doc < len(chunk_counts) or not parts:
        parts.append(Part(len(parts), slice(first_doc, len(chunk_counts)), range(first_row, row)))
    return parts


class BuildFolder:
    """The work folder of one build of ``target`` with inputs ``key`` (see the module's doc)."""

    def __init__(self, path: Path, key: dict) -> None:
        self.path = path
        state_path = path / STATE_FILE
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        if state.get("key") != key:
            if state:
                log.info("%s: another build's work (other inputs); starting afresh", path)
            for child in path.iterdir():
                if child.name != "lock":
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            state = {"key": key, "done": [], "vectors": []}
        elif state["done"] or state["vectors"]:
            log.info(
                "%s: resuming (done: %s; vectors of %d part(s))",
                path,
                ", ".join(state["done"]) or "-",
                len(state["vectors"]),
            )
        if state["vectors"] and not (path / VECTORS_FILE).is_file():  # their file is gone: encode again
            state["vectors"] = []
        self.state = state
        self._save()

    @classmethod
    @contextmanager
    def open(cls, target: Path, key: dict) -> Iterator[BuildFolder]:
        """The folder, locked for this build; kept, with a word on resuming, if the build stops."""
        path = target.parent / f".{target.name}.building"
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"{target}: another build of this index is running (its work: {path})") from None
            folder = cls(path, key)
            try:
                yield folder
            except BaseException:
                if not folder.state["done"] and not folder.state["vectors"]:
                    shutil.rmtree(path, ignore_errors=True)  # nothing finished (bad input, say): nothing to keep
                elif path.is_dir():
                    log.warning("the build stopped; what it finished is kept in %s: the same command resumes", path)
                raise

    def done(self, phase: str) -> bool:
        return phase in self.state["done"]

    def mark(self, phase: str) -> None:
        self.state["done"].append(phase)
        self._save()

    def has_vectors(self, part: int) -> bool:
        return part in self.state["vectors"]

    def save_vectors(self, part: Part, vectors: np.ndarray, chunks: int) -> None:
        """The part's rows of ``vectors.npy`` written, flushed, then recorded as done."""
        array = np.load(self.vectors_file(chunks, vectors.shape[1]), mmap_mode="r+")
        array[part.rows.start : part.rows.stop] = vectors
        array.flush()
        del array
        self.mark_vectors(part.number)

    def vectors_file(self, chunks: int, dimension: int) -> Path:
        """``vectors.npy``, made (``chunks`` rows) if it is not there yet: what the parts' vectors go into."""
        path = self.path / VECTORS_FILE
        if not path.is_file():
            made = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(chunks, dimension))
            made.flush()
            del made
        return path

    def mark_vectors(self, part: int) -> None:
        """The part's vectors are written and flushed: a resumed build keeps them."""
        self.state["vectors"].append(part)
        self._save()

    def vectors(self) -> np.ndarray:
        """Every chunk's vector, memory-mapped (read as the dense index is made)."""
        return np.load(self.path / VECTORS_FILE, mmap_mode="r")

    def finish(self) -> None:
        """The index was swapped in: the work is no longer needed (its state goes first, so that a
        kill halfway through leaves nothing that claims to be done)."""
        (self.path / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)

    def _save(self) -> None:
        partial = self.path / f"{STATE_FILE}.partial"
        partial.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(partial, self.path / STATE_FILE)
