"""The site built once for its tests (`mkdocs build --strict`, pictures drawn from real plans), and docs_build/
importable as MkDocs imports it (its folder on sys.path)."""
import sys

import pytest

from tests.site.browser import ROOT, build_site

sys.path.insert(0, str(ROOT / "docs_build"))


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    return build_site(tmp_path_factory.mktemp("site"))
