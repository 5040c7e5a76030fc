"""Semantic versions and version constraints (paper section 4.1: ``>=1.12.0 <2.0``).

Both the space-separated form and the comma-separated PEP 440 form are accepted:
``">=1.12.0 <2.0"`` and ``">=1.12,<2"`` mean the same thing. A bare version
(``"1.2.3"``) means exactly that version; ``"*"`` or an empty string means any.
"""

from __future__ import annotations

import re

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["parse_constraint", "parse_version", "satisfies"]

_SPLIT = re.compile(r"\s*,\s*|\s+(?=[<>=!~])")
_BARE = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$", re.I)


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion as exc:
        raise ValueError(f"invalid version {text!r}") from exc


def parse_constraint(text: str | None) -> SpecifierSet:
    """Parse a constraint; ValueError names the bad text."""
    if text is None or text.strip() in ("", "*"):
        return SpecifierSet()
    parts = [p for p in _SPLIT.split(text.strip()) if p]
    normalized = [f"=={p}" if _BARE.match(p) else p for p in parts]
    try:
        return SpecifierSet(",".join(normalized))
    except InvalidSpecifier as exc:
        raise ValueError(f"invalid version constraint {text!r}") from exc


def satisfies(version: str, constraint: str | None) -> bool:
    """True when ``version`` meets ``constraint`` (local labels like +cpu are ignored)."""
    spec = parse_constraint(constraint)
    v = parse_version(version)
    return spec.contains(Version(v.public), prereleases=True)
