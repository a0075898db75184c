"""MkDocs hooks (`hooks:` in mkdocs.yml): what the site shows of the code is generated from it when the site builds.

A page asks with a marker line: `<!-- hfsplit:options -->`, `<!-- hfsplit:dataclass hfsplit.plan.Plan -->` or
`<!-- hfsplit:gpu_kinds -->` for a reference table (`reference_tables`), `<!-- hfsplit:memory NAME -->` or
`<!-- hfsplit:timeline NAME -->` for a picture of a plan (`plan_pictures.PICTURES`), drawn into the built site.
Every page's code is marked where it may break across lines (`code_words`: a flag never at its hyphens).
This folder sits outside docs/, so none of it is published."""
from __future__ import annotations

import re

from mkdocs.structure.files import File

import plan_pictures
import reference_tables
from code_words import mark_code_words

MARKER = re.compile(r"^<!-- hfsplit:(\w+)\s*([\w.]*)\s*-->$", re.M)
TABLES = {"options": reference_tables.options_table, "dataclass": reference_tables.dataclass_table,
          "gpu_kinds": reference_tables.gpu_kinds_table}


def on_files(files, config):
    """Add every picture of `plan_pictures.PICTURES`, drawn now, to the site's files."""
    for path, png in plan_pictures.draw_all(plan_pictures.PICTURES).items():
        files.append(File.generated(config, path, content=png))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: _expand(m.group(1), m.group(2), page.file.src_uri), markdown)


def _expand(kind: str, argument: str, page_uri: str) -> str:
    if kind in plan_pictures.CHARTS:
        return plan_pictures.markdown(kind, argument, page_uri=page_uri)
    return TABLES[kind](argument)


def on_page_content(html: str, page, config, files) -> str:
    return mark_code_words(html)
