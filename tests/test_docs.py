"""The README stays short and runnable, and every link in it lands: its commands are the ones `.ci/run` and the
default-run test (`tests/training/test_trainer.py::test_readme_default_command_runs_under_accelerate_launch_and_loss_falls`)
run, and each page or heading it links exists. The docs site's own links, anchors and nav are checked by
`mkdocs build --strict` in `.ci/run`."""
from __future__ import annotations

import contextlib
import io
import re
import unicodedata
from pathlib import Path

import yaml

from hfsplit.cli import main as hfsplit_main
from hfsplit.training.options import ACCELERATE_CPU_CONFIG

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DEFAULT_RUN = 'accelerate launch --config_file "$(hfsplit accelerate-config)" -m hfsplit.finetune'


def first_commands() -> list[str]:
    """The lines of the README's first code block."""
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    return block.group(1).strip().splitlines()


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (its default slugify, code spans as their text)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def test_the_readme_is_short_and_opens_with_the_two_commands():
    assert len(README.splitlines()) < 200
    install_and_run, tests = first_commands()
    assert install_and_run.endswith(DEFAULT_RUN), install_and_run
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()
    assert ci[-1] == "python -m pytest -q"
    assert "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1" in ci
    assert tests == "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 " + ci[-1]


def test_the_default_runs_config_is_the_one_the_default_run_test_launches():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert hfsplit_main(["accelerate-config"]) in (0, None)
    assert Path(out.getvalue().strip()) == Path(ACCELERATE_CPU_CONFIG)


def test_every_readme_link_lands_on_a_page_and_heading_that_exist():
    links = re.findall(r"\]\(((?!https?:)[^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert links
    for path, anchor in links:
        target = ROOT / path
        assert target.is_file(), path
        if anchor:
            assert anchor in anchors(target), (path, anchor, sorted(anchors(target)))


def test_every_docs_page_is_in_the_site_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def pages(entries) -> list[str]:
        out = []
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                out += pages(value) if isinstance(value, list) else [value]
        return out

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == in_nav, (on_disk - in_nav, in_nav - on_disk)


def test_the_comparison_table_names_every_anchor():
    header = next(line for line in README.splitlines() if line.startswith("| | hfsplit |"))
    for name in ('accelerate `device_map="auto"`', "axolotl", "LLaMA-Factory", "Unsloth", "qlora-pipe", "fsdp_qlora"):
        assert name in header, name
