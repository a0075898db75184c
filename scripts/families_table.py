"""Write the sweep of every causal-LM type transformers registers into docs/guides/families.md, and the tp=2 sweep's
findings into hfsplit/models/tp_proven.json (what `tp_degree_error` reads).

    python scripts/families_table.py          # pp=2: about 3 minutes on one CPU core, cached per config afterwards;
                                              # tp=2: one launch of two gloo ranks, about 1.5 minutes
    python scripts/families_table.py --no-tp  # the page only, from the committed tp=2 findings
    python scripts/families_table.py --tp-types qwen3_next,gemma3n_text  # the tp=2 sweep of these types only (their
                                              # findings replaced, the others' kept), then the page

The table is what `hfsplit check --all` prints beside the tp=2 findings; tests/models/test_any_model.py fails when the
page is stale, tests/parallel/test_tp_sweep.py when the findings are.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guides" / "families.md"


def swept_tp(types=None) -> None:
    """Run the tp=2 sweep of `types` (every registered type by default) on two ranks (the tests' launcher: free port,
    every rank killed on failure) and record it."""
    sys.path.insert(0, str(ROOT))
    from hfsplit.load.tp_proof import write_findings
    from tests.parallel.launcher import launch

    verdicts = launch("hfsplit.load.tp_proof:tp_sweep", world_size=2, kwargs={"types": types}, timeout_s=1800)[0]
    write_findings(verdicts)
    print(f"tp=2: {sum(v['proven'] for v in verdicts)} of {len(verdicts)} types proven")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--tp-types" in args:
        swept_tp(args[args.index("--tp-types") + 1].split(","))
    elif "--no-tp" not in args:
        swept_tp()
    from hfsplit.load.proof import all_verdicts, families_markdown, with_table

    PAGE.write_text(with_table(PAGE.read_text(), families_markdown(all_verdicts(progress=True))))
    print(f"wrote {PAGE}")
