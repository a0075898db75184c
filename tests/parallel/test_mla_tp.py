"""GLM-4-MoE-Lite (MLA attention: a latent key/value projection whose rope part every head shares) at tp=2 trained
with LoRA on the whole `kv_a_proj_with_mqa` (the plan's `mla_kv_a_proj`) and fully, 20 steps each, against
transformers + peft in one process: its adapter's rope part gets its gradient summed over the TP group as the base
layer's does (apply/lora.py `shard_adapter`; without it the trained logits drift past the tolerance). The experts'
parameters are left out of the LoRA targets: peft's adapters on fused experts are not sharded under TP."""
import pytest

from tests.parallel import test_families_split as families
from tests.parallel.test_families_split import PROBE, check_case, training_of

reference = families.reference  # the families launch's fixture: transformers (+ peft) trained in one process

pytestmark = pytest.mark.slow

MLA_TARGETS = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "o_proj")


def test_mla_at_tp2_equals_transformers_and_trains_as_one_process(launch, tiny_checkpoint, reference, tmp_path):
    case = dict(name="glm4_moe_lite-tp2", checkpoint=str(tiny_checkpoint("glm4_moe_lite")), tied=False, save=False,
                tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")
    training = training_of(2, 1)
    training["lora"] = dict(training["lora"], lora_targets=MLA_TARGETS)
    results = launch("tests.parallel.family_cases:families_on_split", world_size=2, timeout_s=900,
                     kwargs=dict(cases=[case], training=training, probe=PROBE.tolist(), out_dir=str(tmp_path)))
    check_case(case, [r[case["name"]] for r in results], reference, training=training)
