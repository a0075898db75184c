"""Pictures of results: the plan as per-device memory bars against each budget."""
from __future__ import annotations

from pathlib import Path

from hfsplit.plan import Plan

_PARTS = ("weights", "gradients", "optimizer", "activations", "reserve")
_COLORS = ("#4C72B0", "#DD8452", "#C44E52", "#55A868", "#8C8C8C")


def plan_memory_chart(plan: Plan, path: str | Path) -> Path:
    """Draw one stacked bar per device (replica 0) with its budget as a line; save as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(stage, device) for stage in plan.stages for device in stage.devices[0]]
    gib = 2**30
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(bars) + 2), 4.5))
    for x, (stage, _device) in enumerate(bars):
        bottom = 0.0
        for part, color in zip(_PARTS, _COLORS):
            value = getattr(stage.memory, part) / gib
            ax.bar(x, value, bottom=bottom, color=color, label=part if x == 0 else None, width=0.6)
            bottom += value
        ax.hlines(stage.budget / gib, x - 0.4, x + 0.4, colors="black", linestyles="--",
                  label="budget" if x == 0 else None)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([f"dev {d}\nstage {s.index}\nL{s.layers[0]}-{s.layers[1] - 1}" for s, d in bars], fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.model}: pp={plan.pp} × tp={plan.tp} × dp={plan.dp}, {plan.spec.method}, "
                 f"seq {plan.spec.seq_len}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
