"""What an adaptation leaves: ``adapt/`` (its card and the served graph), written aside and renamed
into place, and the card in a few lines for the command line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.fusion.graph import CARD_FILE, CorpusGraph
from engine.store.index_dir import ADAPT_DIR


def write_card(index_dir: Path, card: dict, graph: CorpusGraph | None) -> None:
    """``adapt/`` written aside and renamed into place (the card last inside it)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{ADAPT_DIR}.writing-", dir=index_dir))
    try:
        if graph is not None:
            graph.save(staging)
        (staging / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
        target = index_dir / ADAPT_DIR
        if target.exists():
            retired = index_dir / f".{ADAPT_DIR}.old-{os.getpid()}"
            os.rename(target, retired)
            os.rename(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def summary(card: dict) -> str:
    """The card in a few lines, for the command line."""
    sets = ", ".join(f"{v['count']} {k}" for k, v in card["pseudo_queries"].items())
    lines = [f"pseudo-queries: {sets}"]
    made = card.get("generation")
    if made:
        lines.append(
            f"questions from {made['server']} ({made['model']}): {made['kept']} kept of {made['asked']} asked"
            f" ({made['rejected']} rejected, {made['failed']} failed), {made['seconds']} s"
        )
    held = card.get("heldout")
    if held:
        kinds = "; ".join(f"{k} {v['rrf']:.4f} -> {v['adapted']:.4f}" for k, v in held["by_kind"].items())
        lines.append(
            f"held-out nDCG@10 ({held['queries']} pseudo-queries): RRF {held['rrf']:.4f}, adapted {held['adapted']:.4f}"
            f" ({kinds})"
        )
    lines.append(card["decision"])
    return "\n".join(lines)
