"""GPU kinds in budgets: the bundled table, parsing, and plans timed with the kinds' rates (or what a run measured)."""
import time
from dataclasses import replace

import pytest

from hfsplit import Plan
from hfsplit.budget import budget_kinds, parse_max_memory
from hfsplit.checkpoint.resolve import load_config
from hfsplit.cli import main
from hfsplit.errors import BudgetError
from hfsplit.gpu_kinds import KINDS, gpu_kind, host_link_bandwidth, kind_of_device_name
from hfsplit.plan import TrainingSpec
from hfsplit.planning.kind_rates import calibration_key, kinds_link, measured_speeds
from hfsplit.planning.links import HOST_COPY_LATENCY_S
from hfsplit.planning.planner import make_plan
from hfsplit.planning.costs.cache import write_cache

GiB = 2**30
MODEL = "Qwen/Qwen2.5-0.5B"
REQUIRED = ("RTX3090", "RTX4090", "RTX5090", "RTXA6000", "L4", "L40S", "A10G", "A100-40GB", "A100-80GB", "H100-80GB",
            "H200", "B200")


def test_the_table_covers_the_kinds_with_every_figure_and_its_source():
    names = {kind.name for kind in KINDS}
    assert set(REQUIRED) <= names
    for kind in KINDS:
        assert kind.memory_bytes > 16 * GiB and kind.bf16_flops > 50e12 and kind.memory_bandwidth > 250e9, kind
        assert kind.host_link.startswith("PCIe ") and kind.host_link_bandwidth in (32e9, 64e9), kind
        assert kind.peer_bandwidth >= kind.host_link_bandwidth and 0 < kind.efficiency <= 1, kind
        assert "datasheet" in kind.source or "whitepaper" in kind.source, kind
        assert kind.source in kind.describe() and f"{kind.bf16_flops / 1e12:.1f} TFLOP/s" in kind.describe()
    # a few figures against their datasheets, dense bf16 and per-direction links
    assert gpu_kind("H100-80GB").bf16_flops == 989.5e12 and gpu_kind("H100").peer_bandwidth == 450e9
    assert gpu_kind("rtx 4090").bf16_flops == 165.2e12 and gpu_kind("A100-80GB").memory_bandwidth == 2039e9
    assert gpu_kind("L4").memory_bytes == 24 * GiB * 15 // 16  # ECC on by default takes 1/16


def test_host_link_bandwidth_per_kind_for_offload_costs():
    assert host_link_bandwidth("RTX4090") == 32e9 and host_link_bandwidth("H100-80GB") == 64e9
    assert host_link_bandwidth(gpu_kind("B200")) == 64e9
    with pytest.raises(BudgetError, match="RTX4080"):
        host_link_bandwidth("RTX4080")


def test_two_kinds_with_different_host_links_charge_offload_in_the_ratio_of_their_links():
    pcie4, pcie5 = kinds_link(budget_kinds("2xRTX4090")), kinds_link(budget_kinds("2xH100-80GB"))
    assert pcie4.host_bandwidth == 25e9 and pcie5.host_bandwidth == 50e9  # a pinned copy's share of 32 and 64 GB/s
    assert kinds_link(budget_kinds("RTX4090,H100-80GB")).host_bandwidth == 25e9  # the slowest kind's
    copies = [replace(link, host_overlap=False).host_copy_s(4e9, 8, compute_s=1.0) - 8 * HOST_COPY_LATENCY_S
              for link in (pcie4, pcie5)]
    assert copies[0] == pytest.approx(2 * copies[1]) and copies[1] == pytest.approx(4e9 / 50e9)
    # in a plan: the same job, offload against checkpointing, copies in line (as a CPU rank runs them) so that the
    # whole copy shows; what offload adds is the host-copy time at each kind's link, 2:1
    spec = TrainingSpec(method="lora", seq_len=2048)
    added = []
    for budget, link in (("2xRTX4090", pcie4), ("2xH100-80GB", pcie5)):
        common = dict(spec=spec, pp=2, schedule="1F1B", micro_batches=8, link=replace(link, host_overlap=False))
        on, off = (make_plan("meta-llama/Llama-3.1-8B", budget, activation_checkpointing=c, **common)
                   for c in (True, "offload"))
        assert [s.layers for s in on.stages] == [s.layers for s in off.stages]
        added.append(off.step_time_s - on.step_time_s)
    assert added[1] > 0 and added[0] == pytest.approx(2 * added[1], rel=0.02)
    assert "host link at 50.00 GB/s (the GPU kind's table)" in " ".join(make_plan(
        "meta-llama/Llama-3.1-8B", "2xH100-80GB", spec=spec, pp=2, activation_checkpointing="offload").notes)


@pytest.mark.parametrize("reported, kind", [
    ("NVIDIA GeForce RTX 4090", "RTX4090"), ("NVIDIA GeForce RTX 3090", "RTX3090"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA A10G", "A10G"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 PCIe", "H100-PCIE"),
    ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"), ("NVIDIA RTX A6000", "RTXA6000"),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 3090 Ti", None), ("Tesla T4", None),
])
def test_a_cuda_device_name_finds_its_kind(reported, kind):
    found = kind_of_device_name(reported)
    assert (found.name if found else None) == kind


@pytest.mark.parametrize("spec, memory, kinds", [
    ("2xRTX4090", [24 * GiB] * 2, ["RTX4090"] * 2),
    ("RTX4090,RTX3090", [24 * GiB] * 2, ["RTX4090", "RTX3090"]),
    ("8xH100-80GB", [80 * GiB] * 8, ["H100-80GB"] * 8),
    ("RTX4090, 12GiB", [24 * GiB, 12 * GiB], ["RTX4090"]),
    ({0: "RTX5090", "cpu": "64GiB"}, [32 * GiB, 64 * GiB], ["RTX5090"]),
])
def test_a_budget_names_gpu_kinds(spec, memory, kinds):
    assert list(parse_max_memory(spec).values()) == memory
    assert [k.name for k in budget_kinds(spec).values()] == kinds


def test_the_dict_form_as_text_means_the_dict():
    assert parse_max_memory("0:24GiB,1:12GiB,cpu:64GiB") == parse_max_memory({0: "24GiB", 1: "12GiB", "cpu": "64GiB"})
    assert list(parse_max_memory("0:24GiB,1:12GiB,cpu:64GiB")) == ["0", "1", "cpu"]
    assert budget_kinds("1:RTX4090,0:RTX3090") == {"1": gpu_kind("RTX4090"), "0": gpu_kind("RTX3090")}


@pytest.mark.parametrize("spec, names", [
    ("2xA100", "write A100-40GB or A100-80GB"), ("RTX4080", "GPU kinds: RTX3090"), ("cpu:RTX4090", "is a GPU kind"),
    ("0:24GiB,12GiB", "name all"), ("0:1GiB,0:2GiB", "given twice"), ({"disk": "RTX4090"}, "disk"),
])
def test_a_bad_kind_or_keyed_budget_is_named(spec, names):
    with pytest.raises(BudgetError, match=names):
        parse_max_memory(spec)


def plan_of_split(capsys, *flags) -> Plan:
    assert main(["plan", MODEL, "--seq-len", "1024", "--json", *flags]) == 0
    return Plan.from_json(capsys.readouterr().out)


def test_plans_for_two_kinds_take_steps_in_the_ratio_of_their_rates(capsys):
    fast = plan_of_split(capsys, "--max-memory", "8xRTX4090", "--tp", "1")
    slow = plan_of_split(capsys, "--max-memory", "8xRTX3090", "--tp", "1")
    assert (fast.pp, fast.dp, fast.schedule, fast.micro_batches) == (slow.pp, slow.dp, slow.schedule,
                                                                    slow.micro_batches)
    rates = gpu_kind("RTX4090").expected_flops / gpu_kind("RTX3090").expected_flops
    assert slow.step_time_s / fast.step_time_s == pytest.approx(rates, rel=0.01)  # the links are alike: PCIe 4.0
    assert any("devices 0-7: RTX4090" in n and "table: NVIDIA Ada" in n for n in fast.notes), fast.notes
    assert any("link between devices: 32 GB/s" in n for n in fast.notes)
    # by size alone the plan knows no kind, and is timed at the planner's unit, as before
    sized = plan_of_split(capsys, "--max-memory", "8x24GiB", "--tp", "1")
    assert sized.step_time_s != pytest.approx(fast.step_time_s, rel=0.05) and not any("table" in n for n in sized.notes)


def test_mixed_kinds_split_the_work_by_speed(capsys):
    """RTX4090,RTX3090: the faster card takes about its rate's share of the work (the stage times balance), where two
    alike 24 GiB cards split it evenly."""
    plan = plan_of_split(capsys, "--max-memory", "RTX4090,RTX3090", "--tp", "1", "--pp", "2", "--schedule", "1F1B")
    rates = {"0": gpu_kind("RTX4090").expected_flops, "1": gpu_kind("RTX3090").expected_flops}
    work = {s.devices[0][0]: s.time_s * rates[s.devices[0][0]] for s in plan.stages}  # FLOPs of each card's stage
    assert 1.6 < work["0"] / work["1"] < 3.2, work  # 2.3x the rate, within one block's granularity
    uniform = plan_of_split(capsys, "--max-memory", "2x24GiB", "--tp", "1", "--pp", "2", "--schedule", "1F1B")
    times = [s.time_s for s in uniform.stages]
    assert max(times) / min(times) < 1.25, times  # alike cards: alike work
    faster = next(s for s in plan.stages if s.devices[0][0] == "0")
    alike = next(s for s in uniform.stages if s.has_head == faster.has_head)  # the same pipeline position
    assert faster.layers[1] - faster.layers[0] > alike.layers[1] - alike.layers[0] + 2


def test_a_runs_measurement_of_the_kind_replaces_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    table = plan_of_split(capsys, "--max-memory", "2xRTX4090", "--tp", "1", "--pp", "2")
    # a run on an RTX 4090 measured twice the table's expected rate for this block shape
    key = calibration_key(load_config(MODEL), table.spec, "RTX4090")
    write_cache("speed", key, {"seconds": 1.0, "split_seconds": 1.0, "flops": 2 * gpu_kind("RTX4090").expected_flops,
                               "measured_at": time.time(), "source": "run"})
    measured = plan_of_split(capsys, "--max-memory", "2xRTX4090", "--tp", "1", "--pp", "2")
    assert measured.step_time_s == pytest.approx(table.step_time_s / 2, rel=0.02)
    note = next(n for n in measured.notes if n.startswith("devices 0, 1: RTX4090"))
    assert "132.2 TFLOP/s measured for this block shape" in note and "calibration cache" in note, note


def test_a_launched_run_scales_the_table_by_its_own_measurement():
    kinds = {"0": gpu_kind("RTX4090"), "1": gpu_kind("RTX3090")}
    budgets = {"0": 1, "1": 1, "2": 1}  # device 2 given by size
    speeds = measured_speeds(kinds, budgets, measured_flops=50e12, here=gpu_kind("RTX4090"), unit=1e12)
    ratio = gpu_kind("RTX3090").expected_flops / gpu_kind("RTX4090").expected_flops
    assert speeds == pytest.approx({"0": 50.0, "1": 50.0 * ratio, "2": 50.0})
    # CPU ranks running a budget of GPU kinds: what runs is the CPU, so its measurement times every device
    assert measured_speeds(kinds, budgets, measured_flops=1e9, here=None, unit=1e12) == \
        pytest.approx({"0": 1e-3, "1": 1e-3, "2": 1e-3})
