"""MkDocs hook: the option and Plan JSON references are generated from the code at build time, so they cannot
drift from it. A page asks for a table with a marker line: `<!-- hfsplit:options -->`,
`<!-- hfsplit:dataclass hfsplit.plan.Plan -->` or `<!-- hfsplit:gpu_kinds -->`."""
from __future__ import annotations

import dataclasses
import importlib
import re
import typing

MARKER = re.compile(r"^<!-- hfsplit:(\w+)\s*([\w.]*)\s*-->$", re.M)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: TABLES[m.group(1)](m.group(2)), markdown)


def options_table(_: str = "") -> str:
    """Every fine-tuning option by group: flag, choices or type, default, help."""
    from hfsplit.training import options as o

    out = []
    for group in o.GROUPS:
        out += [f"### {group.capitalize()}", "", "| flag | values | default | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(o.FinetuneOptions):
            if f.metadata.get("group") != group:
                continue
            choices = o._choices_of(f)
            types = "/".join(t.__name__ for t in o._types_of(f))
            values = " \\| ".join(f"`{c}`" for c in ((True, False) if bool in o._types_of(f) else ()) + choices) \
                or types
            default = "unset" if f.default is None else f"`{f.default}`"
            text = f.metadata["help"].replace("%%", "%").replace("|", "\\|")
            out.append(f"| `--{f.name.replace('_', '-')}` | {values} | {default} | {text} |")
        out.append("")
    return "\n".join(out)


def dataclass_table(path: str) -> str:
    """A dataclass's fields: name, type, default, and its docstring's `Args:` text."""
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    described = _args_of(cls.__doc__ or "")
    hints = typing.get_type_hints(cls)
    out = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING \
            else "`()`" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
        kind = _type_name(hints[f.name]).replace("|", "\\|")
        text = described.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{f.name}` | `{kind}` | {default} | {text} |")
    return "\n".join(out)


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _args_of(doc: str) -> dict[str, str]:
    """`{name: text}` of a transformers-style `Args:` section (names joined by commas share a text)."""
    out, names, section = {}, [], False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            section = True
            continue
        if not section:
            continue
        entry = re.match(r"^\s{4,8}([\w, ]+):\s*(.*)$", line)
        if entry and not line.startswith(" " * 12):
            names = [n.strip() for n in entry.group(1).split(",")]
            for n in names:
                out[n] = entry.group(2)
        elif line.strip() and names:
            for n in names:
                out[n] += " " + line.strip()
        elif not line.strip() and out:
            names = []
    return out


def gpu_kinds_table(_: str = "") -> str:
    """The bundled GPU kinds (`hfsplit.gpu_kinds.KINDS`): every figure the planner times with, and its source."""
    from hfsplit.gpu_kinds import GIB, KINDS

    out = ["| kind | memory | bf16 dense | efficiency | expected | memory bw | host link | GPU-GPU | source; derived |",
           "|---|---|---|---|---|---|---|---|---|"]
    for k in KINDS:
        names = ", ".join(f"`{n}`" for n in (k.name, *k.aliases))
        out.append(f"| {names} | {k.memory_bytes / GIB:.1f} GiB | {k.bf16_flops / 1e12:.1f} TFLOP/s "
                   f"| {k.efficiency:.2f} | {k.expected_flops / 1e12:.1f} TFLOP/s | {k.memory_bandwidth / 1e9:.0f} GB/s"
                   f" | {k.host_link}, "
                   f"{k.host_link_bandwidth / 1e9:.0f} GB/s | {k.peer_bandwidth / 1e9:.0f} GB/s | {k.source}"
                   f"{'; ' + k.notes if k.notes else ''} |")
    return "\n".join(out)


TABLES = {"options": options_table, "dataclass": dataclass_table, "gpu_kinds": gpu_kinds_table}
