"""README reads in one breath, and the guides close to it (issue 48): words per sentence, measured by
tests/support/prose.py. README: at most 18 on average and none over 45. A guide: at most 22 on average.

The guides listed are those rewritten to the limit; a guide joins the list when it is rewritten.
bench/README.md is held as a guide: its tables hold the figures, its prose says how to read them."""

from __future__ import annotations

import pytest

from tests.support.paths import REPO
from tests.support.prose import longest_sentences, measure

GUIDES = ["docs/getting-started.md", "docs/how-it-works.md", "docs/operations.md", "docs/development.md",
          "docs/elastic.md", "docs/aws.md", "docs/ARCHITECTURE.md", "docs/reliability.md",
          "bench/README.md"]


def test_readme_sentences_are_short():
    text = (REPO / "README.md").read_text()
    prose = measure(text)
    assert prose.mean <= 18, f"README averages {prose.mean:.1f} words a sentence (limit 18)"
    assert prose.longest <= 45, f"README sentences over 45 words: {longest_sentences(text, 45)}"


@pytest.mark.parametrize("guide", GUIDES)
def test_a_guide_averages_at_most_22_words_a_sentence(guide):
    prose = measure((REPO / guide).read_text())
    assert prose.mean <= 22, f"{guide} averages {prose.mean:.1f} words a sentence (limit 22)"


def test_the_measure_counts_what_a_reader_reads():
    text = """# A heading that is not prose

One two three. Four five, `six seven eight` nine (see [the docs](docs/x.md)).

- an item without a stop
- another, e.g. this one. And a second sentence here.

```python
code = "is not prose. At all."
```

| a table | is not prose either |
"""
    assert measure(text).lengths == (3, 7, 5, 4, 5)
