"""How long the sentences of a Markdown document are: words per sentence, the share over 40, the longest.

    python -m tests.support.prose README.md docs/*.md

What counts as prose: paragraphs and list items. Code blocks, tables and headings are not prose; inline
code counts as one word, a link as its text. A list item is a sentence of its own even without a full
stop, and a sentence ends at ". ", "! " or "? " before the next one's first character.
tests/project/test_docs_prose.py holds README and the guides to their limits.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_CODE = re.compile(r"`[^`]*`")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "approx.")
_END = re.compile(r"(?<=[.!?])[)\"']?\s+(?=[A-Z0-9(\"'`\[])")


@dataclass(frozen=True)
class Prose:
    """The sentence lengths of one document, in words."""

    lengths: tuple[int, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.lengths) if self.lengths else 0.0

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def over(self, words: int) -> float:
        """The share of sentences longer than `words`."""
        return sum(n > words for n in self.lengths) / len(self.lengths) if self.lengths else 0.0


def units(markdown: str) -> list[str]:
    """The document's paragraphs and list items, each as one line of text (code, tables, headings out)."""
    text = _FENCE.sub("", markdown)
    out: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("|", "#", "<", ">")):
            flush()
            continue
        if _ITEM.match(raw):
            flush()
            line = _ITEM.sub("", raw).strip()
        current.append(line)
    flush()
    return out


def sentences(unit: str) -> list[str]:
    text = _CODE.sub("code", _LINK.sub(r"\1", unit))
    for abbreviation in _ABBREVIATIONS:
        text = text.replace(abbreviation, abbreviation.replace(".", ""))
    return [s for s in _END.split(text) if words(s)]


def words(sentence: str) -> int:
    return sum(1 for token in sentence.split() if re.search(r"[A-Za-z0-9]", token))


def measure(markdown: str) -> Prose:
    return Prose(tuple(words(s) for unit in units(markdown) for s in sentences(unit)))


def longest_sentences(markdown: str, limit: int) -> list[str]:
    """The sentences longer than `limit` words, for an error message."""
    return [s for unit in units(markdown) for s in sentences(unit) if words(s) > limit]


def main(argv: list[str]) -> int:
    print(f"{'file':40} {'sentences':>9} {'words/sentence':>15} {'over 40':>8} {'longest':>8}")
    for name in argv:
        p = measure(Path(name).read_text())
        print(f"{name:40} {len(p.lengths):9d} {p.mean:15.1f} {p.over(40):8.0%} {p.longest:8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
