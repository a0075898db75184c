"""The built site in headless Chromium at a 1280-pixel window (issue 33): the pictures render, and no table or code
block is cut off, wraps a row of a plan table or breaks a flag. CI installs chromium (.ci/run) and fails here
without it; elsewhere the test skips when chromium is absent."""
import os
import time
from pathlib import Path

import pytest

from tests.site.browser import check_pages, chromium

WIDTH = 1280
PICTURE_PAGES = {"": 2, "guides/plan/": 2, "benchmarks/plans/": 4}  # the plans' pictures each page promises


@pytest.fixture(scope="session")  # as the site's: set up first, so no site is built where there is no browser
def browser() -> str:
    if os.environ.get("CI") != "true":
        pytest.importorskip("mkdocs", reason="the site's tests need the docs extra: pip install -e '.[docs]'")
    found = chromium()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed: .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it and runs this test")
    return found


def site_pages(site: Path) -> list[str]:
    """Every page of the built site, by its path ("" for the home page, "guides/plan/", ...)."""
    return sorted(str(p.parent.relative_to(site)) + "/" if p.parent != site else "" for p in site.rglob("index.html")
                  if "search" not in p.parts and "assets" not in p.parts)


def test_the_site_reads_in_a_browser_at_1280_pixels(browser, site):
    pages = site_pages(site)
    assert {"", "guides/plan/", "reference/options/", "benchmarks/plans/"} <= set(pages)
    started = time.monotonic()
    found = check_pages(browser, site, pages, width=WIDTH)
    print(f"\nchromium checked {len(pages)} pages in {time.monotonic() - started:.1f} s")
    assert set(found) == set(pages)
    problems = {}
    for page, result in found.items():
        assert "error" not in result, (page, result)
        assert result["width"] == WIDTH, (page, result["width"])
        bad = [i["src"] for i in result["images"] if not i["ok"]]
        # a benchmark's wide table may scroll in its frame (its key column first, kept in view); nothing else may
        overflow = [o for o in result["overflow"]
                    if not (page.startswith("benchmarks/") and o["tag"].startswith("div.md-typeset__scrollwrap"))]
        if bad or overflow or result["wrapped"] or result["broken"]:
            problems[page] = {"images": bad, "overflow": overflow, "wrapped": result["wrapped"],
                              "broken": result["broken"]}
    assert not problems, problems
    for page, count in PICTURE_PAGES.items():
        rendered = [i for i in found[page]["images"] if "pictures/" in i["src"]]
        assert len(rendered) == count and all(i["width"] > 500 for i in rendered), (page, rendered)
