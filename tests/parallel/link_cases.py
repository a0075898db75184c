"""Rank-side checks of the launch's link probe (run through tests.parallel.launcher)."""


def probe_and_plan() -> dict:
    """Each rank probes the link, then plans a pp=2 split with it; returns what it measured and planned."""
    import time

    from hfsplit.load import probes as calibrate
    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.plan import TrainingSpec
    from hfsplit.parallel.mesh import init_distributed
    from hfsplit.planning.planner import make_plan

    init_distributed()
    start = time.perf_counter()
    link = calibrate.probe_link()
    took = time.perf_counter() - start
    spec = TrainingSpec(method="full", seq_len=64, micro_batch_size=2, dtype="float32", reserve_bytes=0)
    plan = make_plan(tiny_config(), "2x4GiB", spec=spec, pp=2, micro_batches=4, schedule="1F1B", link=link)
    return {"link": link, "probe_s": took, "notes": plan.notes}
