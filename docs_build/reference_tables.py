"""The reference tables of the site, generated from the code when the site builds so that they cannot drift from it:
the options (`options_table`), a dataclass's fields (`dataclass_table`) and the GPU kinds (`gpu_kinds_table`)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import typing


def options_table(_: str = "") -> str:
    """Every fine-tuning option by group: flag, the values its flag takes (as `--help` shows them: `on|off` for a
    switch), default, help."""
    from hfsplit.training.options import GROUPS, FinetuneOptions, add_option_arguments

    parser = argparse.ArgumentParser()
    add_option_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    out = []
    for group in GROUPS:
        out += [f"### {group.capitalize()}", "", "| flag | values | default | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(FinetuneOptions):
            if f.metadata.get("group") == group:
                out.append(_option_row(f, actions[f.name]))
        out.append("")
    return "\n".join(out)


def _option_row(f, action: argparse.Action) -> str:
    """One option's row: its values from the flag's metavar (or the type it converts to), its default as a flag
    takes it."""
    if action.metavar:
        values = " \\| ".join(f"`{v}`" for v in action.metavar.split("|"))
    else:
        values = {int: "int", float: "float", str: "str"}.get(action.type, "str")
    default = "unset" if f.default is None else f"`{_as_flag(f.default)}`"
    text = f.metadata["help"].replace("%%", "%").replace("|", "\\|")
    return f"| `--{f.name.replace('_', '-')}` | {values} | {default} | {text} |"


def _as_flag(value) -> str:
    """A default as its flag takes it: on / off for a switch, a list as A,B."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


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

