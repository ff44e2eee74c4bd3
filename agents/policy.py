"""A caller's policy, enforced deterministically before anything is retrieved or answered.

Rules are ``deny``, ``allow`` or ``require``, each matched by ``keywords`` (case-insensitive, on
word boundaries) and/or regular expressions (``pattern`` or ``patterns``) over the task and its
context; a rule matches when any of its keywords or patterns does. A matched deny rule is a
violation; an unmatched require rule is a violation; when no rule matches at all,
``default_action`` decides (``deny`` makes that a violation). Deny always wins: an allow rule does
not excuse a matched deny rule. Patterns run on the ``regex`` engine with a size limit and a match
timeout, so a pathological pattern cannot hang the server; one that does not compile, or times
out, is the caller's error, naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import regex
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_PATTERN_CHARS = 500
MATCH_TIMEOUT_S = 0.05


class PolicyError(ValueError):
    """A rule that cannot be evaluated; the message names it."""


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128)
    type: Literal["deny", "allow", "require"]
    description: str = ""
    keywords: list[str] = Field(default_factory=list, max_length=200)
    pattern: str | None = Field(None, max_length=MAX_PATTERN_CHARS)
    patterns: list[str] = Field(default_factory=list, max_length=50)

    @model_validator(mode="after")
    def _something_to_match(self) -> Rule:
        if not self.keywords and not self.pattern and not self.patterns:
            raise ValueError(f"rule {self.id!r} has no keywords, pattern or patterns")
        if any(len(p) > MAX_PATTERN_CHARS for p in self.patterns):
            raise ValueError(f"rule {self.id!r}: a pattern is over {MAX_PATTERN_CHARS} characters")
        return self


class PolicyDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[Rule] = Field(default_factory=list, max_length=200)
    default_action: Literal["allow", "deny"] = "allow"


@dataclass
class Verdict:
    compliant: bool
    violations: list[dict] = field(default_factory=list)
    applied_rules: list[str] = field(default_factory=list)


def evaluate(policy: PolicyDoc, texts: list[str]) -> Verdict:
    """Which rules match ``texts`` and whether that breaks the policy."""
    text = "\n".join(t for t in texts if t)
    compiled = {rule.id: _compile(rule) for rule in policy.rules}
    violations, applied = [], []
    for rule in policy.rules:
        matched = _matches(rule, compiled[rule.id], text)
        if matched:
            applied.append(rule.id)
        if rule.type == "deny" and matched:
            violations.append(_violation(rule, f"matched {matched}"))
        elif rule.type == "require" and not matched:
            violations.append(_violation(rule, "required but not found"))
    if not applied and policy.default_action == "deny":
        violations.append({"rule_id": "default_action", "type": "deny", "reason": "no rule allows this task"})
    return Verdict(not violations, violations, applied)


def _compile(rule: Rule) -> list:
    found = []
    for keyword in rule.keywords:
        found.append(regex.compile(rf"(?<!\w){regex.escape(keyword.strip())}(?!\w)", regex.IGNORECASE))
    for pattern in ([rule.pattern] if rule.pattern else []) + rule.patterns:
        try:
            found.append(regex.compile(pattern, regex.IGNORECASE))
        except regex.error as exc:
            raise PolicyError(f"rule {rule.id!r}: pattern {pattern!r} does not compile ({exc})") from None
    return found


def _matches(rule: Rule, compiled: list, text: str) -> str | None:
    for expression in compiled:
        try:
            hit = expression.search(text, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise PolicyError(
                f"rule {rule.id!r}: pattern took over {MATCH_TIMEOUT_S * 1000:.0f} ms; simplify it"
            ) from None
        if hit:
            return repr(hit.group(0))
    return None


def _violation(rule: Rule, reason: str) -> dict:
    return {"rule_id": rule.id, "type": rule.type, "description": rule.description, "reason": reason}
