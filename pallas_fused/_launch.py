"""How our kernels meet Pallas' launchers, and the small integer helpers their launch grids share."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_fused import _jax_compat


@functools.cache
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids."""
    return -(-a // b)


def grouped_pid(pid, num_m: int, num_n: int, group_m: int):
    """Map a 1-D program id to (pid_m, pid_n), walking group_m rows of tiles at a time: the programs that run at
    once share a few row tiles and a few column tiles (L2 reuse of both operands of a GEMM)."""
    width = group_m * num_n
    group = pid // width
    first_m = group * group_m
    size = jnp.minimum(num_m - first_m, group_m)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    return pid_m, pid_n


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: Sequence[int] | int,
    name: str,
    interpret: bool,
    in_specs: Any = pl.no_block_spec,
    out_specs: Any = pl.no_block_spec,
    num_warps: int = 4,
    num_stages: int | None = None,
    input_output_aliases: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
    """`pl.pallas_call` with the Triton lowering: the only place our kernels meet Pallas' launcher."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=dict(input_output_aliases or {}),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )


def mosaic_rcp_rn(v, *, layout):
    """1 / v, correctly rounded (PTX rcp.rn.f32), of an fp32 Mosaic GPU array in `layout`: Mosaic GPU's own fp32
    division is not correctly rounded. Through Mosaic GPU's own arrays (`plgpu.inline_mgpu`), which its interpret
    mode does not run: there divide, as XLA's division is correctly rounded."""
    plgpu = _jax_compat.mosaic_gpu()

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(v.shape, v.dtype, layout=layout))
    def rcp(_, array):
        return array._pointwise(array._lift_fast_instr("rcp.rn.f32"))

    return rcp(v)
