"""A budget this machine cannot honour is refused before a byte is read (issue 33, item 2); the reserve is charged
only where there is one; the closest split offered is one the single process can load."""
import pytest
import torch

from hfsplit import BudgetError, PlanError, TrainingSpec, make_plan
from hfsplit.budget import check_devices_here, format_size, parse_max_memory
from hfsplit.checkpoint.synthetic import TINY_MODEL, tiny_config
from hfsplit.cli.plan import main as plan_main
from hfsplit.load.materialize import from_pretrained

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")


def tiny():
    spec = dict(TINY_MODEL)
    return tiny_config(spec.pop("arch"), **spec)


@no_cuda
@pytest.mark.parametrize("budget, instead", [
    ({0: "24GiB", 1: "12GiB", "cpu": "64GiB"}, "{'cpu': '64GiB'}"),  # the README's own
    ("2x2GiB", "{'cpu': '4GiB'}"),
    ("0:1GiB,1:512MiB", "{'cpu': '1536MiB'}"),
    ({"cuda:1": "8GiB"}, "{'cpu': '8GiB'}"),
])
def test_a_gpu_budget_on_a_machine_without_cuda_is_one_line_naming_the_device_and_what_to_pass(budget, instead,
                                                                                               tmp_path):
    # the folder holds nothing: the refusal comes before the config, let alone a weight, is read
    with pytest.raises(BudgetError) as err:
        from_pretrained(tmp_path / "no-model-here", max_memory=budget)
    message = str(err.value)
    assert "\n" not in message
    assert "is not present: this machine has no CUDA" in message and f"pass max_memory={instead}" in message
    assert "or run on GPUs" in message


@no_cuda
def test_a_device_map_on_a_missing_gpu_is_refused_before_reading(tmp_path):
    with pytest.raises(BudgetError, match=r"device map: device 0 is not present"):
        from_pretrained(tmp_path / "no-model-here", plan={"model.embed_tokens": 0, "lm_head": "cpu"})


def test_the_cpu_and_the_devices_this_process_sees_are_accepted():
    check_devices_here({"cpu": 1 << 30})
    check_devices_here({str(i): 1 << 30 for i in range(torch.cuda.device_count())})


@no_cuda
def test_hfsplit_plan_still_plans_for_gpus_that_are_not_here(capsys):
    """A dry run: it plans the GPUs a user will run on; only loading refuses them."""
    assert plan_main(["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x8GiB", "--inference"]) == 0
    assert "pp=" in capsys.readouterr().out


@pytest.mark.parametrize("size, text", [(4 << 30, "4GiB"), (1536 << 20, "1536MiB"), (1000, "1000B")])
def test_format_size_is_what_a_budget_takes_back(size, text):
    assert format_size(size) == text and parse_max_memory(text) == {"0": size}


def test_a_cpu_stage_of_a_single_process_carries_no_gpu_reserve():
    plan = make_plan(tiny(), {0: "2GiB", "cpu": "1GiB"}, spec=TrainingSpec(method="inference"), tp=1, pp=2,
                     single_process=True)
    reserves = {stage.devices[0][0]: stage.memory.reserve for stage in plan.stages}
    assert reserves["cpu"] == 0 and reserves["0"] > 0


def test_a_single_process_is_charged_no_nccl_buffers():
    from hfsplit.planning.reserve import NCCL_BUFFER_BYTES

    spec = TrainingSpec(method="inference")
    one = make_plan(tiny(), "2x2GiB", spec=spec, tp=1, single_process=True)
    launched = make_plan(tiny(), "2x2GiB", spec=spec, tp=1, world_size=2)
    assert launched.stages[0].memory.reserve - one.stages[0].memory.reserve == NCCL_BUFFER_BYTES


def test_the_closest_split_offered_to_one_process_is_one_it_can_load():
    """tp=1 (one process places whole blocks): the no-fit names no tensor-parallel split."""
    with pytest.raises(PlanError) as err:
        make_plan(tiny(), "2x770MiB", spec=TrainingSpec(method="inference"), tp=1, single_process=True)
    assert "closest split: pp=2 × tp=1" in str(err.value) and "tp=2" not in str(err.value)
