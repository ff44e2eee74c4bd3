"""Answers in the shape a task expects: ``list`` (sorted distinct strings), ``single``, ``json``.

When the answer is text to be parsed (an LLM's reply), items are found by a fallback chain: a
JSON array (also inside a code fence; nested arrays flattened), then a numbered or bulleted list,
then a comma or semicolon split, then the whole string.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

Format = Literal["list", "single", "json"]
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_ITEM = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+(.*\S)\s*$")


def items_from_text(text: str) -> list[str]:
    """The items a text lists, by the first rule of the chain that finds any."""
    for candidate in [*_FENCE.findall(text), text]:
        start, end = candidate.find("["), candidate.rfind("]")
        if 0 <= start < end:
            try:
                parsed = json.loads(candidate[start : end + 1])
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, list):
                found = [str(x).strip() for x in _flatten(parsed) if str(x).strip()]
                if found:
                    return found
    listed = [m.group(1) for line in text.splitlines() if (m := _ITEM.match(line))]
    if listed:
        return listed
    parts = [p.strip() for p in re.split(r"[;,]", text) if p.strip()]
    if len(parts) > 1:
        return parts
    return [text.strip()] if text.strip() else []


def format_answer(items: list[str], expected: Format, extra: dict | None = None) -> list[Any]:
    """``answers`` for the response: always a list, whose content the format decides."""
    distinct = list(dict.fromkeys(i.strip() for i in items if i and i.strip()))
    if expected == "list":
        return sorted(distinct)
    if expected == "single":
        return [" ".join(distinct)] if distinct else []
    return [{"answer": " ".join(distinct), "items": distinct, **(extra or {})}]


def _flatten(values: list) -> list:
    flat = []
    for value in values:
        flat.extend(_flatten(value) if isinstance(value, list) else [value])
    return flat
