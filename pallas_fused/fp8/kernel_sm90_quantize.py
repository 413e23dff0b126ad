"""The blockwise FP8 quantize as a Hopper (sm90) Mosaic GPU kernel: an activation's two copies, or a weight's.

Same numbers and outputs as `kernel.quantize_blockwise(x, dtype, block_n, block_t)`, x (R, C) read once and q (R, C)
and q^T (C, R) written from it, scales in the GEMM's K-block-major layout:
  - activations and gradients (block_n = (1, 128), block_t = (128, 1)): one scale per 1 x 128 block along C for q,
    one per 1 x 128 block along R (a 128 x 1 block of x) for q^T; q_scales (C / 128, R), qt_scales (R / 128, C).
  - weights (`square`: block_n = block_t = (128, 128)): one scale per 128 x 128 tile, the same for q and q^T;
    q_scales (C / 128, R / 128) and qt_scales (R / 128, C / 128), each the other's transpose.

Each program owns `steps` 128 x 128 tiles of x and streams them through a `stages`-deep ring of shared memory by
TMA. One warpgroup loads a tile into registers twice: as it is (each row of x is a block of q) and transposed, by a
transposed 16-bit shared-memory load (ldmatrix.trans on Hopper), so that each row of the register tile is a column
of x, a block of q^T. Either way an activation block's amax is a row reduction inside a warp (a weight tile's is
the maximum of its rows', one reduction across the warpgroup's warps before the tile is cast), and both fp8 tiles
are stored into shared memory untransposed and leave by TMA: no 8-bit data is transposed in registers or through
shared memory byte by byte, which is where the Triton kernel loses its time. The rows are taken `chunk` at a time
(64: half the registers of a whole tile per thread).

Several programs share an SM (one warpgroup each; `smem_bytes` sets how many fit): one's loads overlap another's
arithmetic, as the ring overlaps a program's own next tiles with its current one.
Shapes: R and C multiples of 128 (`supported`); callers pad or route elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._sm90 import _smem_transforms
from pallas_fused.fp8.kernel import _abs_key, _key_amax, fp8_cast
from pallas_fused.fp8.reference import finite_abs, scale_from_amax

TILE = 128  # the block length of both copies: a program's tile is TILE x TILE elements of x
SCALE_WORDS = 4  # a weight tile's scale is stored this many times over: TMA moves 16 bytes at least


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    steps: int = 1  # tiles per program (the largest divisor of the tile count up to it is taken)
    stages: int = 1  # x tiles in flight per program (the shared-memory ring)
    out_slots: int = 1  # output tiles per program whose TMA stores may still be reading shared memory
    chunk: int = 64  # rows of a register tile at a time (64 or 128)
    # The amax as a max of integer keys of |x| (`kernel._abs_key`: a shift and an add per element) instead of a max
    # of `reference.finite_abs` (abs, the finite test and its select).
    key_amax: bool = True


# The launches of a GPU without a tuning table, for activations ("launch") and weights: the H200's
# (the sweeps: docs/performance.md, "Tuning tables").
HEURISTIC = {"launch": dataclasses.asdict(QuantizeConfig()),
             "weight": dataclasses.asdict(QuantizeConfig(chunk=128, key_amax=False))}


def launch_config(square: bool = False) -> QuantizeConfig:
    """This device kind's launch for activations or (`square`) weights (its tuning table's "fp8_blockwise_sm90",
    else HEURISTIC)."""
    return QuantizeConfig(**_backend.tuned("fp8_blockwise_sm90", HEURISTIC)["weight" if square else "launch"])


def smem_bytes(config: QuantizeConfig) -> int:
    """Shared memory of one program: the ring of bf16 tiles and the output slots (two fp8 tiles, two scale rows)."""
    return config.stages * TILE * TILE * 2 + config.out_slots * (2 * TILE * TILE + 2 * TILE * 4)


def supported(r: int, c: int, x_dtype=jnp.bfloat16) -> bool:
    """Whether the kernel takes an x of this shape and dtype: 16-bit (its tile is read transposed from shared memory
    by a 16-bit transposed load), both dimensions multiples of TILE."""
    return (r > 0 and c > 0 and r % TILE == 0 and c % TILE == 0
            and jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _row_amax(x, key_amax: bool):
    """The amax of each row of an fp32 register tile, as an integer key (`kernel._abs_key`) or as fp32."""
    return jnp.max(_abs_key(x), axis=1) if key_amax else jnp.max(finite_abs(x), axis=1)


def _block_scales(amax, dtype, power_of_2: bool, reciprocal, key_amax: bool):
    """(scale, 1 / scale) of blocks from their amaxes as `_row_amax` gives them. The cast is x * (1 / scale) with
    the reciprocal correctly rounded, as the Triton kernel's: a last-bit error moves the codes of values at a
    rounding tie, which bf16 inputs hit (subnormal fp8 codes above all)."""
    scale = scale_from_amax(_key_amax(amax) if key_amax else amax, dtype, power_of_2)
    return scale, reciprocal(scale)


def _cast_rows(x, inv, cast):
    """A (rows, TILE) fp32 register tile cast to fp8, each row times its block's 1 / scale."""
    return cast(x * lax.broadcast_in_dim(inv, x.shape, [0]))


def _kernel(x_gmem, q_gmem, qt_gmem, *scale_gmem, config: QuantizeConfig, programs: int, dtype,
            power_of_2: bool, cast, reciprocal, square: bool):
    plgpu = _backend.mosaic_gpu()
    n_cols = x_gmem.shape[1] // TILE
    steps, stages, slots, chunk = config.steps, config.stages, config.out_slots, config.chunk
    program = lax.axis_index("program")

    def tile_of(step):
        """The (row, column) tile of x of a step: consecutive programs take consecutive tiles, as a plain grid."""
        t = step * programs + program
        return t // n_cols, t % n_cols

    @functools.partial(
        pl.run_scoped,
        x_smem=plgpu.SMEM((stages, TILE, TILE), x_gmem.dtype, transforms=_smem_transforms(plgpu, TILE, x_gmem.dtype)),
        q_smem=plgpu.SMEM((slots, 2, TILE, TILE), dtype, transforms=_smem_transforms(plgpu, TILE, dtype)),
        s_smem=plgpu.SMEM((slots, 2, TILE), jnp.float32),
        loaded=plgpu.Barrier(num_barriers=stages),
    )
    def _scope(x_smem, q_smem, s_smem, loaded):
        def fetch(step, slot):
            i, j = tile_of(step)
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)], x_smem.at[slot],
                                    loaded.at[slot])

        for step in range(min(stages, steps)):
            fetch(step, step)

        @pl.loop(0, steps)
        def _step(step):
            slot, out = lax.rem(step, stages), lax.rem(step, slots)
            i, j = tile_of(step)
            plgpu.barrier_wait(loaded.at[slot])
            # The output slot is free once the TMA stores of the tile that last used it have read it.
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
            tile = x_smem.at[slot]

            def load_rows(k):
                return _backend.mosaic_load(tile.at[pl.ds(k * chunk, chunk)],
                                            layout=plgpu.Layout.WGMMA).astype(jnp.float32)

            def scales(x):
                return _block_scales(_row_amax(x, config.key_amax), dtype, power_of_2, reciprocal, config.key_amax)

            if square:
                # The tile's one scale, before any of it is cast: the rows' amaxes (the chunks' maximum row by row),
                # then their maximum across the warps, given to every row of every chunk and of both copies. The
                # chunks stay in registers for q's cast (the whole tile, as the tuned weight launch loads it anyway).
                rows_of = [load_rows(k) for k in range(TILE // chunk)]
                tile_amax = functools.reduce(jnp.maximum, [_row_amax(x, config.key_amax) for x in rows_of])
                tile_amax = jnp.broadcast_to(jnp.max(tile_amax), tile_amax.shape)
                scale, inv = _block_scales(tile_amax, dtype, power_of_2, reciprocal, config.key_amax)
            for k in range(TILE // chunk):
                part = pl.ds(k * chunk, chunk)
                # q: rows [k, k + chunk) of the tile, one block per row (or the tile's)
                x = rows_of[k] if square else load_rows(k)
                if not square:
                    scale, inv = scales(x)
                q_smem[out, 0, part] = _cast_rows(x, inv, cast)
                s_smem[out, 0, part] = scale
                # q^T: columns [k, k + chunk) of the tile, loaded transposed, one block per (register) row
                xt = _backend.mosaic_load(tile.at[:, part].transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED)
                xt = plgpu.layout_cast(xt, plgpu.Layout.WGMMA).astype(jnp.float32)
                if not square:
                    scale, inv = scales(xt)
                    s_smem[out, 1, part] = scale
                q_smem[out, 1, part] = _cast_rows(xt, inv, cast)
            # Every thread's shared-memory reads of the x tile and writes of the outputs are done (a warpgroup
            # barrier, then the fence that orders them before the TMA engine's accesses).
            plgpu.commit_smem()

            @pl.when(step + stages < steps)
            def _():
                fetch(step + stages, slot)

            rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
            plgpu.copy_smem_to_gmem(q_smem.at[out, 0], q_gmem.at[rows, cols], commit_group=False)
            plgpu.copy_smem_to_gmem(q_smem.at[out, 1], qt_gmem.at[cols, rows], commit_group=False)
            if square:
                # The tile's one scale, as the smallest TMA store (16 bytes: SCALE_WORDS copies of it), into
                # qt_scales' tile (i, j); q_scales is its transpose.
                [ts_gmem] = scale_gmem
                plgpu.copy_smem_to_gmem(s_smem.at[out, 0, pl.ds(0, SCALE_WORDS)],
                                        ts_gmem.at[i, pl.ds(j * SCALE_WORDS, SCALE_WORDS)], commit_group=False)
            else:
                qs_gmem, qts_gmem = scale_gmem
                plgpu.copy_smem_to_gmem(s_smem.at[out, 0], qs_gmem.at[j, rows], commit_group=False)
                plgpu.copy_smem_to_gmem(s_smem.at[out, 1], qts_gmem.at[i, cols], commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _steps(n_tiles: int, want: int) -> int:
    """The largest divisor of n_tiles not above `want`."""
    return max(d for d in range(1, min(want, n_tiles) + 1) if n_tiles % d == 0)


@functools.partial(jax.jit, static_argnames=("dtype", "power_of_2", "interpret", "config", "square"))
def quantize_blockwise_sm90(x, *, dtype, power_of_2: bool = False, interpret: bool = False,
                            config: QuantizeConfig | None = None, square: bool = False):
    """(q, q_scales, q^T, qt_scales) of a 2-D x (R, C), R and C multiples of 128: exactly
    `kernel.quantize_blockwise(x, dtype=dtype, block_n=(1, 128), block_t=(128, 1), power_of_2=power_of_2)`, or with
    `square`, a weight's 128 x 128 tiles: `block_n=block_t=(128, 128)`.

    interpret=True runs the kernel in Mosaic GPU's interpret mode on the CPU (jax >= 0.12; slow, for tests)."""
    name = "pallas_fused_fp8_quantize_blockwise_sm90"
    config = config or launch_config(square)
    dtype = jnp.dtype(dtype)
    if x.ndim != 2 or not supported(*x.shape, x.dtype):
        raise ValueError(f"{name}: x must be 2-D bfloat16 or float16 with both dimensions positive multiples of "
                         f"{TILE}, got {x.shape} {x.dtype}")
    if config.chunk not in (64, 128) or config.stages < 1 or config.out_slots < 1 or config.steps < 1:
        raise ValueError(f"{name}: chunk must be 64 or 128 and steps, stages, out_slots positive, got {config}")
    r, c = x.shape
    n_tiles = (r // TILE) * (c // TILE)
    config = dataclasses.replace(config, steps=_steps(n_tiles, config.steps))
    programs = n_tiles // config.steps
    cast = fp8_cast(dtype, interpret)
    f32 = jnp.float32
    plgpu = _backend.mosaic_gpu()
    # A block's scale is one per row of the register tile (a row reduction of the WGMMA layout).
    reciprocal = (lambda s: 1.0 / s) if interpret else functools.partial(
        _backend.mosaic_rcp_rn, layout=plgpu.Layout.WGMMA.reduce(1))

    def body(*refs):
        _kernel(*refs, config=config, programs=programs, dtype=dtype, power_of_2=power_of_2, cast=cast,
                reciprocal=reciprocal, square=square)

    body.__name__ = body.__qualname__ = name  # the kernel's name in profiles
    if square:  # one scale per tile, SCALE_WORDS times over, in qt_scales' layout (q_scales is its transpose)
        scales = (jax.ShapeDtypeStruct((r // TILE, c // TILE * SCALE_WORDS), f32),)
    else:
        scales = (jax.ShapeDtypeStruct((c // TILE, r), f32), jax.ShapeDtypeStruct((r // TILE, c), f32))
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((r, c), dtype), jax.ShapeDtypeStruct((c, r), dtype), *scales),
        grid=(programs,),
        grid_names=("program",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **(dict(interpret=_backend.mosaic_interpret(name)) if interpret else {}),
    )
    if square:
        q, qt, qt_scales = kernel(x)
        qt_scales = qt_scales[:, ::SCALE_WORDS]
        return q, qt_scales.T, qt, qt_scales
    q, qt, q_scales, qt_scales = kernel(x)
    return q, q_scales, qt, qt_scales
