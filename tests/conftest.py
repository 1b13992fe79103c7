"""Shared fixtures; `gpu`-marked tests run only where a CUDA device of capability 9.0 (Hopper) is present."""
import os
import secrets

# Without a GPU the DSL would target its newest architecture: compile tests target Hopper.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and any(
        torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count())
    )


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device of capability 9.0 (Hopper)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A fresh random generator per test; its seed is printed (shown on failure) and can be pinned
    with CUTE_DEFORM_SEED to replay a failure."""
    seed = int(os.environ.get("CUTE_DEFORM_SEED", secrets.randbits(63)))
    print(f"{request.node.nodeid}: seed {seed}")
    return torch.Generator().manual_seed(seed)
