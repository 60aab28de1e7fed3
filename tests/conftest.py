import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

logging.basicConfig(level=logging.INFO)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """(arch, dtype) -> (HF model, folder), built once per session."""
    import torch

    cache: dict = {}

    def get(arch: str, dtype=torch.float32):
        key = (arch, dtype)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{arch}-{str(dtype).split('.')[-1]}")
            cache[key] = make_tiny_model(arch, folder, dtype)
        return cache[key]

    return get
