"""Write the sweep of every causal-LM type transformers registers into docs/guides/families.md.

    python scripts/families_table.py        # about 3 minutes on one CPU core; cached per config afterwards

The table is what `hfsplit check --all` prints; tests/models/test_any_model.py fails when the page is stale.
"""
from pathlib import Path

from hfsplit.load.proof import all_verdicts, families_markdown, with_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "families.md"

if __name__ == "__main__":
    PAGE.write_text(with_table(PAGE.read_text(), families_markdown(all_verdicts(progress=True))))
    print(f"wrote {PAGE}")
