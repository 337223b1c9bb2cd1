"""Text of a rich-rendered CLI output, independent of the terminal's width.

rich wraps messages and draws panels to fit ``COLUMNS`` (80 when unset), so a phrase can be split across lines
or interrupted by a panel's border. Tests match on :func:`flat`, which drops the box-drawing characters and
collapses every run of whitespace to one space, so they assert what was said, not how it was laid out.
"""

import re

_BOX = re.compile(r"[\u2500-\u257f]")  # rich's panel and table borders


def flat(text: str) -> str:
    """``text`` without box drawing, its whitespace collapsed to single spaces."""
    return " ".join(_BOX.sub(" ", text).split())
