"""How the served index presents itself to agents choosing a tool: its name and one line on what it
holds, from its manifest (:meth:`~engine.store.index_dir.Manifest.presented`), in MCP's instructions
and tool descriptions and in the A2A card. An index of NFCorpus keeps the wording the benchmark has
always seen; the tool name ``search_nfcorpus`` stays whatever was indexed (the benchmark calls it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.store.index_dir import IndexDirError, default_presentation, read_manifest


@dataclass(frozen=True)
class Presentation:
    name: str  # "NFCorpus"
    description: str  # "NFCorpus medical abstracts"

    @classmethod
    def of(cls, index_dir: Path) -> Presentation:
        """The index's own, or NFCorpus's where no index is at hand (an A2A door in front of another
        server's MCP)."""
        try:
            return cls(*read_manifest(Path(index_dir)).presented())
        except IndexDirError:
            return cls(*default_presentation("nfcorpus"))

    @property
    def tags(self) -> list[str]:
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return [slug, "medical"] if slug == "nfcorpus" else [slug] if slug else []
