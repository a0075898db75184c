"""What the charts share: colours, the figure they draw on, the title naming the plan, and how a figure is saved.
matplotlib loads only when a chart is drawn."""
from __future__ import annotations

from pathlib import Path

from hfsplit.plan import Plan

GIB = 2**30
PART_COLORS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer": "#C44E52", "activations": "#55A868",
               "reserve": "#8C8C8C", "host": "#D9D9D9"}
DPI = 110


def figure(*, width: float, height: float, rows: int = 1, sharex: bool = False):
    """A new figure and the list of its `rows` axes (a column), drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(width, height), sharex=sharex, squeeze=False,
                             layout="constrained")
    return fig, [row[0] for row in axes]


def save(fig, path: str | Path) -> Path:
    """Write `fig` as a PNG at `path` and free it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", format="png")  # at `path` as given (no ".png" appended)
    plt.close(fig)
    return path


def split_title(plan: Plan) -> str:
    """The plan in one line: model, method, shape, split and schedule."""
    spec = plan.spec
    split = f"pp={plan.pp} × tp={plan.tp} × dp={plan.dp}" + (f" (replica 0 of {plan.dp})" if plan.dp > 1 else "")
    return (f"{plan.model}: {spec.method}, seq {spec.seq_len} × micro-batch {spec.micro_batch_size}, "
            f"{plan.micro_batches} micro-batches\n{split}, {plan.schedule}")
