"""The site's pictures of plans, drawn when the site builds from the plans `hfsplit plan` makes for the commands below
(bundled configs, no network, no weights), so a picture cannot drift from what the planner says. Nothing is committed:
each PNG lives in the built site only."""
from __future__ import annotations

import contextlib
import io
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hfsplit.cli import main as hfsplit_main
from hfsplit.cli.charts import plan_memory_chart, plan_timeline_chart
from hfsplit.plan import Plan

FOLDER = "pictures"  # where the PNGs sit in the site


@dataclass(frozen=True)
class Picture:
    """A plan worth a picture: its name in the site, what it shows, and the `hfsplit plan` command that makes it."""

    name: str
    caption: str
    command: str


PICTURES = {p.name: p for p in (
    Picture("llama70b_2x4090", "Llama-3.1-70B QLoRA r=16, seq 2048, on two RTX 4090s (3% kept free)",
            "hfsplit plan meta-llama/Llama-3.1-70B --max-memory 2xRTX4090 --qlora --lora-r 16 --seq-len 2048 "
            "--headroom 0.03"),
    Picture("qwen14b_24_12_12", "Qwen2.5-14B LoRA r=16, seq 2048, on a 24 GiB card and two 12 GiB ones",
            "hfsplit plan Qwen/Qwen2.5-14B --max-memory 24GiB,12GiB,12GiB --seq-len 2048 --lora-r 16"),
    Picture("gptoss120b_4x4090", "gpt-oss-120b QLoRA r=16, seq 2048, on four RTX 4090s: two stages a GPU",
            "hfsplit plan openai/gpt-oss-120b --max-memory 4xRTX4090 --qlora --lora-r 16 --seq-len 2048 "
            "--micro-batch-size 1"),
)}
CHARTS = {"memory": plan_memory_chart, "timeline": plan_timeline_chart}
ALT = {"memory": "Memory per GPU", "timeline": "One step of the pipeline per rank"}


def planned(picture: Picture) -> Plan:
    """The Plan `picture.command` prints with `--json` (its exit code 0, or the build fails)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hfsplit_main(shlex.split(picture.command)[1:] + ["--json"])
    if code:
        raise RuntimeError(f"{picture.command} exited {code}: {err.getvalue()}")
    return Plan.from_json(out.getvalue())


def draw_all(names) -> dict[str, bytes]:
    """`{site path: PNG bytes}`: both charts of each named picture."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="hfsplit-site-") as folder:
        for name in names:
            plan = planned(PICTURES[name])
            for chart, draw in CHARTS.items():
                path = draw(plan, Path(folder) / f"{chart}-{name}.png")
                out[f"{FOLDER}/{path.name}"] = path.read_bytes()
    return out


def markdown(chart: str, name: str, *, page_uri: str) -> str:
    """The picture's image and caption for a page at `page_uri` (its link relative to the page, as MkDocs checks)."""
    picture = PICTURES[name]
    up = "../" * page_uri.count("/")
    return (f"![{ALT[chart]}: {picture.caption}]({up}{FOLDER}/{chart}-{name}.png)\n\n"
            f"*{ALT[chart]}: {picture.caption}. Drawn when this site was built, from the plan of* "
            f"`{picture.command}`")
