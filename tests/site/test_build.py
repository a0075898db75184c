"""What the site build publishes and generates: documentation only, the plans' pictures drawn from real plans, the
option reference reading switches as the CLI takes them, benchmark pages that open with their result and command."""
import argparse
import os
import re

import matplotlib.image
import pytest

if os.environ.get("CI") != "true":  # CI installs the docs extra and must run these
    pytest.importorskip("mkdocs", reason="the site's tests need the docs extra: pip install -e '.[docs]'")

import hooks  # noqa: E402  (docs_build/, on sys.path as MkDocs puts it: see conftest)
import plan_pictures  # noqa: E402
import reference_tables  # noqa: E402
from hfsplit.training.options import add_option_arguments  # noqa: E402
from tests.site.browser import ROOT  # noqa: E402

BENCHMARKS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))


def test_only_documentation_is_published(site):
    published = {p.suffix for p in site.rglob("*") if p.is_file()}
    assert ".py" not in published and ".md" not in published, published
    assert not (ROOT / "docs" / "hooks.py").exists()
    assert sorted(p.name for p in (site / "pictures").iterdir()) == sorted(
        f"{chart}-{name}.png" for name in plan_pictures.PICTURES for chart in plan_pictures.CHARTS)


def test_every_picture_a_page_asks_for_is_in_the_site_and_drawn(site):
    asked = {(m.group(1), m.group(2)) for page in (ROOT / "docs").rglob("*.md")
             for m in hooks.MARKER.finditer(page.read_text()) if m.group(1) in plan_pictures.CHARTS}
    assert {name for _, name in asked} == set(plan_pictures.PICTURES)
    for chart, name in asked:
        height, width, _ = matplotlib.image.imread(site / plan_pictures.FOLDER / f"{chart}-{name}.png").shape
        assert width > 500 and height > 200, (chart, name)


def test_a_picture_is_of_the_plan_its_command_prints():
    plan = plan_pictures.planned(plan_pictures.PICTURES["llama70b_2x4090"])
    assert (plan.model, plan.pp, plan.spec.method, plan.spec.seq_len) == ("meta-llama/Llama-3.1-70B", 2, "qlora", 2048)
    assert all(s.memory.total <= s.budget * 0.97 for s in plan.stages)  # --headroom 0.03, as the caption says


def test_a_picture_links_from_any_page_depth():
    text = plan_pictures.markdown("memory", "llama70b_2x4090", page_uri="benchmarks/plans.md")
    assert "(../pictures/memory-llama70b_2x4090.png)" in text
    assert "(pictures/memory-llama70b_2x4090.png)" in plan_pictures.markdown("memory", "llama70b_2x4090",
                                                                             page_uri="index.md")
    assert plan_pictures.PICTURES["llama70b_2x4090"].command in text


def test_the_option_reference_reads_switches_as_the_cli_takes_them():
    table = reference_tables.options_table()
    assert "True" not in table and "False" not in table
    row = next(line for line in table.splitlines() if line.startswith("| `--trust-remote-code` |"))
    assert row.startswith("| `--trust-remote-code` | `on` \\| `off` | `off` |"), row
    parser = argparse.ArgumentParser()
    add_option_arguments(parser)
    for action in parser._actions:  # every switch's values are its flag's metavar, in order
        if action.metavar and action.metavar.startswith("on|off"):
            flag = action.option_strings[0]
            values = " \\| ".join(f"`{v}`" for v in action.metavar.split("|"))
            assert f"| `{flag}` | {values} |" in table, flag


def test_code_breaks_only_at_spaces_and_after_a_paths_slashes():
    html = ('<p><code>--trust-remote-code x</code> a/b</p><td><code>load/test_x.py</code></td>'
            '<pre><code><span class="w"> </span>--max-memory 2x</code></pre>')
    out = hooks.on_page_content(html, None, None, None)
    assert '<code><span class="whole">--trust-remote-code</span> x</code> a/b</p>' in out  # prose left alone
    assert '<code>load/<wbr>test_x.py</code>' in out
    assert '<span class="w"> </span><span class="whole">--max-memory</span> 2x' in out
@pytest.mark.parametrize("page", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_page_opens_with_its_result_and_command(page):
    """Its opening (up to the first table or section) names a command and says no commit id or branch name."""
    opening = re.split(r"^(?:## |\|)", page.read_text(), maxsplit=1, flags=re.M)[0]
    assert re.search(r"`(?:python|pytest|hfsplit|accelerate|torchrun)[^`]*`|```bash", opening), opening
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", opening), opening
    assert not re.search(r"\bbranch\b|\bmain\b", opening), opening
