import pytest


@pytest.fixture(scope="session")
def multimodal(tmp_path_factory):
    """Factory: `multimodal(kind)` → the folder of a tiny multimodal checkpoint (written once per session)."""
    from tests.multimodal.checkpoints import write_multimodal

    made = {}

    def make(kind: str) -> str:
        if kind not in made:
            made[kind] = str(write_multimodal(tmp_path_factory.mktemp(kind), kind))
        return made[kind]

    return make
