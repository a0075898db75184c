"""The cost model: bytes and FLOPs of one decoder block, the embeddings and the head (`model`), from the real model
class on the meta device (`layout`) and traces under FakeTensorMode (`trace`; TP degrees `tp`, LoRA `lora`, masks
`masks`, MoE experts `moe`), cached in memory and on disk (`traces`, `cache`)."""
