"""Where code may break across lines on the site. A word of code that holds a hyphen (a flag, a model name) is kept
whole: it goes in a `whole` span, which docs/stylesheets/extra.css sets nowrap, so neither a narrow table column nor
a code block's wrapped line breaks `--trust-remote-code` at its hyphens. Any other word may break after each of its
slashes (a path: `parallel/<wbr>test_split_model.py`), and nowhere else; code otherwise breaks at its spaces."""
from __future__ import annotations

import re

CODE = re.compile(r"(<code[^>]*>)(.*?)(</code>)", re.S)
TAG_OR_TEXT = re.compile(r"(<[^>]*>)|([^<]+)")
WORD = re.compile(r"[^\s<>]+")


def mark_code_words(html: str) -> str:
    """`html` with the words of every code element's text (never of its tags) marked as above."""
    return CODE.sub(_code, html)


def _code(code: re.Match) -> str:
    inner = TAG_OR_TEXT.sub(lambda part: part.group(1) or WORD.sub(_word, part.group(2)), code.group(2))
    return code.group(1) + inner + code.group(3)


def _word(word: re.Match) -> str:
    text = word.group(0)
    if "-" in text:
        return f'<span class="whole">{text}</span>'
    return text.replace("/", "/<wbr>")
