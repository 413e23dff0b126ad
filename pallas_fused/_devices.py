"""The GPU this process chooses implementations and lowers kernels for: the one it has, or one it stands in for.

`gpu_target` lets a process without that GPU (a CPU exporting a step for CUDA, the lowering tests) answer as if it
had one; every question below answers for the innermost target first.
"""

from __future__ import annotations

import contextlib

import jax


def gpu_device() -> jax.Device | None:
    """The first CUDA device, or None."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


# A GPU to choose implementations and lower kernels for, in a process that may have none (see `gpu_target`).
_TARGET: list[tuple[tuple[int, int], str, int]] = []
# The GPUs `gpu_target` can stand for: compute capability -> (device kind, SM count).
TARGETS = {(8, 0): ("NVIDIA A100-SXM4-80GB", 108), (9, 0): ("NVIDIA H100 80GB HBM3", 132)}


@contextlib.contextmanager
def gpu_target(compute_capability: tuple[int, int]):
    """Choose implementations and lower kernels as for a CUDA GPU of `compute_capability` ((8, 0) or (9, 0)).

    For a process without that GPU: exporting a step for one (`jax.export.export(..., platforms=["cuda"])`) or
    checking that every kernel lowers for it on a CPU (tests/test_lowering.py). Inside, `implementation=None`
    and "pallas" pick that GPU's kernels and the shape rules use its SM count; running them still needs the GPU.
    jax's Triton lowering reads the GPU from the abstract mesh's device when the process has none."""
    if tuple(compute_capability) not in TARGETS:
        raise ValueError(f"gpu_target: compute_capability must be one of {sorted(TARGETS)}, got {compute_capability}")
    kind, sms = TARGETS[tuple(compute_capability)]
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=sms, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu_target",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    _TARGET.append((tuple(compute_capability), kind, sms))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        _TARGET.pop()


def compute_capability() -> tuple[int, int] | None:
    if _TARGET:
        return _TARGET[-1][0]
    device = gpu_device()
    if device is None:
        return None
    text = str(getattr(device, "compute_capability", "0.0"))
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def is_hopper() -> bool:
    cc = compute_capability()
    return cc is not None and cc[0] == 9


def device_name() -> str:
    if _TARGET:
        return _TARGET[-1][1]
    device = gpu_device() or jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


def num_sms() -> int:
    if _TARGET:
        return _TARGET[-1][2]
    device = gpu_device()
    return int(getattr(device, "core_count", 0) or 132) if device is not None else 1
