"""What a plan leaves out of the checkpoint it was made for: a multimodal checkpoint's towers, fine-tuned as text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LeftOut:
    """The modules of a multimodal checkpoint beside the language model a plan covers (vision or audio towers,
    projectors): neither planned, loaded onto the devices nor trained; a full save copies them unchanged, an adapter
    leaves them as they are.

    Args:
        checkpoint: the checkpoint's model_type ("gemma3"; the plan's `model_type` is its language model's).
        modules: the outermost modules holding them, as the checkpoint's class names them ("model.vision_tower").
        parameters: their parameters in all.
    """

    checkpoint: str
    modules: tuple[str, ...]
    parameters: int

    @classmethod
    def of(cls, data: Optional[dict]) -> Optional["LeftOut"]:
        """From its JSON form (a plan's, or a config's note from `hfsplit.checkpoint.multimodal`); None from None."""
        return None if data is None else cls(data["checkpoint"], tuple(data["modules"]), int(data["parameters"]))

    def line(self) -> str:
        """One line of the plan's table."""
        if not self.modules:
            return f"multimodal {self.checkpoint} checkpoint: its language model alone (it holds no tower)"
        return (f"multimodal {self.checkpoint} checkpoint: only its language model is planned and trained; "
                f"{', '.join(self.modules)} ({_count(self.parameters)} parameters) left out of training, never "
                "loaded, copied unchanged on a full save")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
