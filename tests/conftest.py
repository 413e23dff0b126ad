"""Shared pytest setup: the `gpu` marker, the kernel implementation to test, float64 references."""

import jax
import pytest

from pallas_fused import _backend

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
    if _backend.gpu_device() is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_impl() -> str:
    """The Pallas kernel as it runs here: compiled on a GPU, interpreted on the CPU."""
    return "pallas" if _backend.gpu_device() is not None else "interpret"
