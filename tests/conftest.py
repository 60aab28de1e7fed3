import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

logging.basicConfig(level=logging.INFO)
# MOONCAKED_NATIVE=0 is a user's switch, not a property of the machine: the suite tests the native kernels
# wherever the CPU runs them (test_four_bit.py tests the switch itself)
os.environ.pop("MOONCAKED_NATIVE", None)


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
