"""Pictures of a plan, drawn with matplotlib: its memory per GPU (`memory`) and one step of its pipeline per rank
(`timeline`). `hfsplit plan --png` draws the first; the docs site draws both from real plans when it builds; the
recipe draws a training step as the ranks ran it beside its plan's timeline (`run_timeline_chart`)."""
from hfsplit.cli.charts.memory import device_bars, plan_memory_chart
from hfsplit.cli.charts.timeline import measured_timeline_chart, plan_timeline_chart, run_timeline_chart

__all__ = ["device_bars", "measured_timeline_chart", "plan_memory_chart", "plan_timeline_chart", "run_timeline_chart"]
