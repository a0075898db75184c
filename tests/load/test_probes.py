"""The calibrated time model: one real block timed once per device kind, dtype and shape, then read back."""
import pytest
import torch
from transformers import LlamaConfig

from hfsplit.load import probes as calibrate
from hfsplit.planning import timing
from hfsplit.plan import TrainingSpec


def _config(layers: int = 2):
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)


def test_probe_written_once_reused_and_keyed_by_kind_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    calls = []
    real = calibrate._time_block
    monkeypatch.setattr(calibrate, "_time_block", lambda *a: calls.append(a) or real(*a))
    spec = TrainingSpec(method="full", seq_len=32, micro_batch_size=2, dtype="float32")
    cpu = torch.device("cpu")
    first = calibrate.block_flops_per_s(_config(), spec, cpu)
    assert first > 1e6 and len(calls) == 1 and len(list(tmp_path.glob("speed-*.json"))) == 1
    assert calibrate.block_flops_per_s(_config(), spec, cpu) == first and len(calls) == 1  # read back
    calibrate.block_flops_per_s(_config(), TrainingSpec(method="full", seq_len=32, micro_batch_size=2,
                                                        dtype="bfloat16"), cpu)
    assert len(calls) == 2  # another dtype is another measurement
    monkeypatch.setattr(calibrate, "device_kind", lambda device: "another-cpu")
    calibrate.block_flops_per_s(_config(), spec, cpu)
    assert len(calls) == 3 and len(list(tmp_path.glob("speed-*.json"))) == 3


def test_known_gpu_table_and_speeds_relative_to_the_planner_unit(tmp_path, monkeypatch):
    from hfsplit.planning.timing import DEVICE_FLOPS

    assert timing.known_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.5e12 * 0.40)
    assert timing.known_flops("NVIDIA L40S") == pytest.approx(362.05e12 * 0.40)  # not "L4"
    assert timing.known_flops("NVIDIA L4") == pytest.approx(121e12 * 0.30)
    assert timing.known_flops("RTX4090") == pytest.approx(165.2e12 * 0.40)
    assert timing.known_flops("Some NPU") is None
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    spec = TrainingSpec(method="lora", seq_len=16, dtype="float32", lora_r=4)
    speeds = calibrate.calibrated_speeds(_config(), spec, {"0": 1, "1": 1}, torch.device("cpu"))
    flops = calibrate.block_flops_per_s(_config(), spec, torch.device("cpu"))
    assert speeds == {"0": flops / DEVICE_FLOPS, "1": flops / DEVICE_FLOPS}


def test_probe_times_a_gemma3_block_whose_rope_is_per_layer_type():
    """Gemma 3's rotary embedding takes the layer type; the probe hands block 0 its own table."""
    from hfsplit.checkpoint.synthetic import tiny_config

    spec = TrainingSpec(method="full", seq_len=16, micro_batch_size=1, dtype="float32")
    assert min(calibrate._time_block(tiny_config("gemma3_text"), spec, torch.device("cpu"))) > 0


def _wrong_by(factor: float, config, spec, device) -> dict:
    """Measure the block, then store a record `factor`× too fast (as a probe on a quieter machine would)."""
    from hfsplit.planning.costs.cache import write_cache

    record = calibrate.speed_record(config, spec, device)
    wrong = {**record, "seconds": record["seconds"] / factor, "split_seconds": record["split_seconds"] / factor}
    write_cache("speed", calibrate.speed_key(config, spec, device), wrong)
    return wrong


def test_a_run_whose_busy_time_contradicts_the_cached_speed_replaces_it(tmp_path, monkeypatch):
    from hfsplit.planning.planner import make_plan
    from hfsplit.planning.costs.cache import read_cache

    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    config, cpu = _config(4), torch.device("cpu")
    spec = TrainingSpec(method="full", seq_len=32, micro_batch_size=2, dtype="float32", reserve_bytes=0)
    wrong = _wrong_by(4.0, config, spec, cpu)
    key = calibrate.speed_key(config, spec, cpu)

    def plan():
        speeds = calibrate.calibrated_speeds(config, spec, {"0": 1, "1": 1}, cpu)
        return make_plan(config, "2x1GiB", spec=spec, pp=2, micro_batches=4, schedule="1F1B", device_speeds=speeds)

    before = plan()
    estimates = [sum(s.time_s for s in before.stages_of_rank(r)) * before.micro_batches for r in (0, 1)]
    steps = [9.0, 1.0, 1.0]  # busy seconds cover the two timed steps (the first builds the schedule)
    agreeing = calibrate.recheck_speed(before, config, cpu, step_times_s=steps, busy_s=[2 * 1.2 * e for e in estimates])
    assert agreeing is None and read_cache("speed", key) == wrong  # within RECHECK_FACTOR: kept
    line = calibrate.recheck_speed(before, config, cpu, step_times_s=steps, busy_s=[2 * 4 * e for e in estimates])
    assert line is not None and "4.00× the estimate" in line
    fixed = read_cache("speed", key)
    assert fixed["source"] == "run" and fixed["seconds"] == pytest.approx(4 * wrong["seconds"])
    assert fixed["split_seconds"] / fixed["seconds"] == pytest.approx(wrong["split_seconds"] / wrong["seconds"])
    after = plan()  # the next plan of this device and shape runs on the run's rate
    assert after.step_time_s == pytest.approx(4 * before.step_time_s, rel=1e-2)  # (the sends do not scale)
    assert calibrate.recheck_speed(after, config, cpu, step_times_s=steps,
                                   busy_s=[2 * 4 * e for e in estimates]) is None
    monkeypatch.setattr(calibrate, "MAX_AGE_S", 0.0)  # an aged record is measured again
    assert calibrate.speed_record(config, spec, cpu)["source"] == "probe"


def test_zero_bubble_slots_pay_the_measured_split_backward():
    from hfsplit.planning.links import Link
    from hfsplit.planning.planner import make_plan

    spec = TrainingSpec(method="full", seq_len=8, micro_batch_size=1, dtype="float32", reserve_bytes=0)
    options = dict(spec=spec, micro_batches=4, pp=2, device_speeds={"0": 1e-3, "1": 1e-3})
    for schedule, charged in (("1F1B", 1.0), ("Interleaved1F1B", 1.0), ("ZBVZeroBubble", 1.5)):
        one, split = (make_plan(_config(4), "2x1GiB", schedule=schedule, **options,
                                link=Link(bandwidth=1e12, split_backward=f, measured=True)) for f in (1.0, 1.5))
        assert [s.time_s for s in split.stages] == pytest.approx([charged * s.time_s for s in one.stages], rel=1e-3)
    # the probe's own figure is a timing (no bound on it here: under load it swings); it is the cached record's
    spec = TrainingSpec(method="full", seq_len=32, dtype="float32")
    factor = calibrate.split_backward_factor(_config(), spec, torch.device("cpu"))
    record = calibrate.speed_record(_config(), spec, torch.device("cpu"))
    assert record["split_seconds"] > 0 and record["seconds"] > 0
    assert factor == max(1.0, record["split_seconds"] / record["seconds"])


def test_link_fit_through_two_sizes_and_its_costs():
    from hfsplit.planning.links import Link, fit_link

    link = fit_link((1000, 1_001_000), (2e-5, 1.02e-3))  # 1 GB/s with 19 µs latency
    assert link.bandwidth == pytest.approx(1e9) and link.latency_s == pytest.approx(1.9e-5) and link.measured
    assert fit_link((1000, 2000), (1e-3, 5e-4)) == Link(4e6, 0.0, True)  # noisy: the large size's own rate
    assert link.send_s(1e6) == pytest.approx(1.9e-5 + 1e-3)
    # ring all-reduce over 4 ranks: 6 messages of a quarter each
    assert link.all_reduce_s(4e6, 4, count=2) == pytest.approx(2 * (6 * 1.9e-5 + 6e6 / 1e9))
    assert link.all_reduce_s(4e6, 1) == 0.0


def test_planner_charges_the_link_for_pipeline_sends_and_tp_all_reduces():
    from hfsplit.planning.costs.model import model_costs
    from hfsplit.planning.links import DEFAULT_LINK, Link
    from hfsplit.planning.planner import make_plan

    config = _config()
    spec = TrainingSpec(method="full", seq_len=32, micro_batch_size=2, dtype="float32", reserve_bytes=0)
    options = dict(spec=spec, micro_batches=4, schedule="1F1B", device_speeds={"0": 1e-3, "1": 1e-3})
    fast = make_plan(config, "2x1GiB", pp=2, **options)
    slow_link = Link(bandwidth=1e7, latency_s=1e-3, measured=True)
    slow = make_plan(config, "2x1GiB", pp=2, link=slow_link, **options)
    hidden = model_costs(config, spec).boundary_bytes
    assert hidden == 2 * 32 * 64 * 4
    # each stage has one neighbour: activations forward and their gradient back, per micro-batch
    expected = 2 * (slow_link.send_s(hidden) - DEFAULT_LINK.send_s(hidden))
    assert [b.time_s - a.time_s for a, b in zip(fast.stages, slow.stages)] == pytest.approx([expected] * 2)
    assert slow_link.describe() in slow.notes and "measured" in slow_link.describe()
    tp_fast = make_plan(config, "2x1GiB", tp=2, pp=1, **options)
    tp_slow = make_plan(config, "2x1GiB", tp=2, pp=1, link=slow_link, **options)
    assert tp_slow.step_time_s > tp_fast.step_time_s + 2 * 4 * 4 * slow_link.latency_s  # 4 all-reduces a block
    # on a slow link the planner stops splitting a model this small
    auto = {**options, "schedule": "auto", "dp": 1}
    split = make_plan(config, "2x1GiB", **auto)
    alone = make_plan(config, "2x1GiB", link=slow_link, **auto)
    assert split.tp * split.pp == 2 and (alone.tp, alone.pp) == (1, 1)


@pytest.mark.slow
def test_link_probe_on_two_ranks_agrees_and_reaches_the_plan():
    from tests.parallel.launcher import launch

    results = launch("tests.parallel.link_cases:probe_and_plan", world_size=2, timeout_s=120)
    links = [r["link"] for r in results]
    assert links[0] == links[1]  # every rank plans with the same (slowest) figure
    link = links[0]
    assert link.measured and 1e7 < link.bandwidth < 1e12 and 0 <= link.latency_s < 0.05 and 0 < link.action_s < 0.05
    # the host link the activation offload crosses: a memory copy beside compute on a CPU rank, measured
    assert 1e7 < link.host_bandwidth < 1e12 and not link.host_overlap and "(device table)" not in link.describe()
    assert all(r["probe_s"] < 5 for r in results)
    assert any(note.startswith("link ") and "measured" in note for note in results[0]["notes"])


@pytest.mark.parametrize("schedule, sends, actions", [
    ("1F1B", [1, 1], 2),
    ("Interleaved1F1B", [1, 2, 2, 1], 2),  # looped: every turn crosses ranks
    ("ZBVZeroBubble", [1, 1, 1, 1], 3),  # V: the turn (stages 1 → 2) stays on rank 1; backward split in two
])
def test_slots_count_cross_rank_sends_and_schedule_actions(schedule, sends, actions):
    from hfsplit.planning.search import stage_slots
    from hfsplit.schedules import virtual_stages

    slots = stage_slots([("0",), ("1",)], {"0": 1, "1": 1}, {}, p=2, d=1, v=virtual_stages(schedule, 2), m=4,
                   schedule=schedule)
    assert [s.sends for s in slots] == sends and {s.actions for s in slots} == {actions}


def test_action_cost_makes_many_small_actions_slower():
    from hfsplit.planning.links import Link
    from hfsplit.planning.planner import make_plan

    spec = TrainingSpec(method="full", seq_len=8, micro_batch_size=1, dtype="float32", reserve_bytes=0)
    options = dict(spec=spec, micro_batches=4, pp=2, device_speeds={"0": 1e-3, "1": 1e-3})
    steps = {}
    for action_s in (0.0, 1e-2):
        link = Link(bandwidth=1e9, action_s=action_s, measured=True)
        steps[action_s] = {s: make_plan(_config(4), "2x1GiB", schedule=s, link=link, **options).step_time_s
                           for s in ("1F1B", "ZBVZeroBubble")}
        steps[action_s]["auto"] = make_plan(_config(4), "2x1GiB", link=link, **options).schedule
    assert steps[0.0]["ZBVZeroBubble"] < steps[0.0]["1F1B"] and steps[0.0]["auto"] != "1F1B"
    assert steps[1e-2]["ZBVZeroBubble"] > steps[1e-2]["1F1B"] and steps[1e-2]["auto"] == "1F1B"
    assert 0 < calibrate.action_seconds(torch.device("cpu")) < 0.01
