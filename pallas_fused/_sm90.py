"""One Hopper (sm90) GEMM skeleton for our Mosaic GPU kernels: TMA-fed, warp-specialized wgmma, with an epilogue.

out = epilogue(a @ b, row vectors, column vectors), cast to out_dtype. a is (M, K) K-major; b is (K, N) ("kn",
16-bit only) or (N, K) ("nk": K-major, the only layout wgmma reads for 8-bit operands). The epilogue gets the fp32
accumulator tile of one warpgroup and the slices of the row vectors ((M,) each) and column vectors ((N,) each)
that cover it, as float32 in the WGMMA row / column layouts, and returns the fp32 tile to store. A vector of shape
(1,) holds one value for every row (column), as a tensorwise scale does: the kernel reads it once, and the epilogue
gets it as an fp32 scalar (no vector is materialised or copied per tile).

Per-K-step promotion (optional: `promote` with step row vectors ((K / tile_k, M) each) and step column vectors
((K / tile_k, N) each)): each K step's wgmma product goes into a zeroed step accumulator instead, and
promote(step product, that step's row slices, its column slices) is added into a separate fp32 accumulator, which
the epilogue then gets. Blockwise FP8 scaling uses it (DeepSeek-V3's per-128 promotion: the tensor cores' fast
fp8 accumulation never runs longer than one K step, and each step's scales apply in fp32). Per K step each
compute warpgroup issues its wgmma, loads the step's scales while it runs, waits for it and promotes; when the
step's SMEM stage is released is tuning data (TileConfig.early_release). A step accumulator is a fresh ACC
allocation (zeroed, as wgmma accumulates onto it) and the sum a loop carry, so the path runs in Mosaic GPU's
interpret mode too (it cannot run a re-zeroing store into an accumulator ref).

A dequantisation (optional: `a_dequant`, for quantised weights; QDoRA uses it): a arrives by TMA in its stored dtype
(int8 / uint8: half the bytes of bf16 through HBM and the SMEM ring), and each compute warpgroup loads its slice of
the step's a tile into registers, converts it to b's 16-bit dtype there, a_dequant(stored tile), and feeds it to
the wgmma as its A operand, which may live in registers (B may not): no round trip through shared memory. Per-row
scales belong in the epilogue (and a low-rank term beside them in `lowrank`, divided by them): the dequant sees the
tile alone. The result may be stored transposed (`transpose_out`: each 16-bit epilogue tile written into SMEM
transposed, then TMA-stored as any tile), so the caller computes c^T = b^T a^T with the quantised operand as a.

Low-rank step (optional: `lowrank` = (la (M, R), lb (R, N) or (N, R) in b's layout), 16-bit, R a multiple of 16):
la @ lb goes into the same fp32 accumulator as a @ b before the epilogue (not with `promote`), so
a LoRA-style x W + (x A) (s B) is one kernel. Each compute warpgroup TMA-copies its (tile_m, R) slice of la and
its R x tile_n slice of lb into SMEM when a tile starts (the copies overlap the main loop, as the vector slices
do) and issues one more wgmma after the main loop. The two slices take 2 (tile_m + tile_n) R bytes of SMEM per
warpgroup beside the ring: `smem_bytes` counts it, and `matmul` refuses a configuration that does not fit.

Structure (adapted from jax's hopper_matmul_mgpu.py example): a persistent grid of one CTA per SM walks the
output tiles in a planar snake; in each CTA a memory warpgroup streams (cta_tile_m, tile_k) tiles of a and the
matching tiles of b through a `max_concurrent_steps`-deep SMEM ring, and two compute warpgroups each own a
(tile_m, tile_n) fp32 accumulator. The vector slices are TMA-copied into SMEM when a tile starts, overlapping
its main loop; the result leaves through SMEM in (epi_tile x epi_tile) TMA stores.

Cluster (optional: TileConfig.cluster = "m" | "n", as jax's example's cluster_dimension): the grid is one cluster of
two CTAs per two SMs, the snake walks (2 cta_m, cta_n) ("m") or (cta_m, 2 cta_n) ("n") cluster tiles, and each CTA
takes its half. The two CTAs of a cluster along M read the same b tile each K step (along N, the same a tile): its
BlockSpec is collective over the cluster, so each step's shared tile is one multicast TMA load into both CTAs' rings
instead of two trips through L2, and a stage is refilled only once both CTAs have released it (cluster barriers).
Shapes must then be multiples of the cluster tile (`TileConfig.cluster_tile`). Every path (vectors, promotion,
a's dequant, low-rank step, transposed store) runs with it: their other loads stay per CTA.

Ping-pong schedule (TileConfig.schedule = "pingpong"): the two compute warpgroups own whole (tile_m, tile_n) output
tiles instead of halves of one CTA tile: the CTA's persistent walk gives its i-th tile to warpgroup i % 2, and the
memory warpgroup streams the K steps of every tile, in walk order, through one SMEM ring that both share. Each
warpgroup runs its tile's main loop, then its epilogue, which overlaps the other warpgroup's main loop on the next
tile; the tensor cores never idle for an epilogue as they do in the cooperative schedule, where both warpgroups
store at once. Barriers: per ring stage one "full" barrier per warpgroup (a warpgroup waits on every phase of its
own, never on the other's loads, which phase-tracked waits could not skip) and one "consumed" barrier the owner
releases once its wgmma has read the stage (one wgmma stays in flight: a stage is released a K step late); and a
"turn" barrier per warpgroup, which the other arrives on once it has issued its tile's last K step, so the main
loops take turns and one warpgroup's wgmmas are not spread over the other's. FP8 (or 16-bit) row and column vectors
only: not with promotion, a's dequant, the low-rank step or a transposed store. With a cluster, the two CTAs' j-th
tiles share a's rows ("n") or b's columns ("m") and belong to the same warpgroup: the shared tile of each K step is
one multicast load, and its stage is refilled once both CTAs' owners have released it (cluster barriers).

Users: fp8/kernel_sm90.py (row and column scales, per-K-step promotion) and dora/kernel_sm90.py (column scale g and
bias with the low-rank step; QDoRA: int8 a, row scales, the result stored transposed).
Shapes must be multiples of the CTA (cluster) tile and tile_k; callers pad or route elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend


@dataclasses.dataclass(frozen=True)
class TileConfig:
    tile_m: int = 128  # rows per compute warpgroup
    tile_n: int = 128  # columns per compute warpgroup
    tile_k: int = 128  # K per pipeline step (128 bytes of a row at 8 bits: the widest swizzle)
    max_concurrent_steps: int = 4  # SMEM ring depth
    wg_split: str = "n"  # the two compute warpgroups split the CTA tile along "m" or "n"
    grid_minor_dim: str = "n"
    grid_tile_width: int = 8
    epi_tile: int = 64
    # Used only with `promote`: release a K step's SMEM stage as soon as its wgmma is done, before the promotion
    # (the memory warpgroup refills it meanwhile), instead of after the step's body.
    early_release: bool = False
    # Two CTAs of a cluster side by side along "m" (they share b's tile) or "n" (they share a's): the shared tile
    # is loaded once per cluster and multicast into both CTAs' shared memory, halving its trips through L2.
    cluster: str | None = None
    # "cooperative": both compute warpgroups work on every K step of one CTA tile, then both store. "pingpong": each
    # owns whole (tile_m, tile_n) tiles, every other one of the CTA's walk, so one stores while the other computes
    # (module docstring); wg_split does not apply.
    schedule: str = "cooperative"

    @property
    def cta_tile(self) -> tuple[int, int]:
        if self.schedule == "pingpong":  # the unit of the walk: one warpgroup's tile
            return self.tile_m, self.tile_n
        if self.wg_split == "m":
            return 2 * self.tile_m, self.tile_n
        return self.tile_m, 2 * self.tile_n

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """The output tile of one cluster (of one CTA without `cluster`): what shapes must be multiples of."""
        cta_m, cta_n = self.cta_tile
        return cta_m * (2 if self.cluster == "m" else 1), cta_n * (2 if self.cluster == "n" else 1)


Epilogue = Callable[[jax.Array, Sequence[jax.Array], Sequence[jax.Array]], jax.Array]
# promote(step product, step row slices, step column slices) -> the fp32 tile added to the running accumulator.
Promote = Epilogue
# a_dequant(a's stored (tile_m, tile_k) tile of one warpgroup) -> that tile in b's 16-bit dtype, or in any dtype
# the kernel then converts to it (integer codes exact in 16 bits as they are).
Dequant = Callable[[jax.Array], jax.Array]


def _smem_transforms(plgpu, minor: int, dtype):
    """TMA / wgmma tiling and swizzle of an SMEM tile whose minor dimension holds `minor` elements of `dtype`."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


COMPUTE_WGS = 2  # compute warpgroups per CTA; the pipeline adds one memory warpgroup after them


def _pipeline_specs(plgpu, a_gmem, b_gmem, step_gmems, *, config: TileConfig, b_layout: str, n_step_rows: int):
    """The SMEM blocks the cooperative pipeline's memory warpgroup TMA-loads each K step: a's (cta_m, tile_k) tile,
    b's tile in its layout, and one (1, cta) row of each step vector. The operand both CTAs of a cluster read is one
    collective (multicast) load. The step vectors ride the pipeline beside a and b (in the same SMEM ring stage and
    under the same barrier), so a step's scales are in SMEM exactly when its tiles are; a separate per-step TMA
    would need its own barrier ring."""
    tile_n, tile_k = config.tile_n, config.tile_k
    cta_m, cta_n = config.cta_tile
    transforms = _smem_transforms(plgpu, tile_k, a_gmem.dtype)
    # b's minor dimension is K ("nk") or N ("kn"), of which a warpgroup reads its tile_n columns.
    b_transforms = _smem_transforms(plgpu, tile_k if b_layout == "nk" else tile_n, b_gmem.dtype)
    smem_spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
    a_shared = dict(collective_axes=("cluster",)) if config.cluster == "n" else {}
    b_shared = dict(collective_axes=("cluster",)) if config.cluster == "m" else {}
    if b_layout == "nk":
        b_spec = smem_spec((cta_n, tile_k), lambda kk: (0, kk), transforms=b_transforms, **b_shared)
    else:
        b_spec = smem_spec((tile_k, cta_n), lambda kk: (kk, 0), transforms=b_transforms, **b_shared)
    step_specs = [smem_spec((1, cta_m if i < n_step_rows else cta_n), lambda kk: (kk, 0))
                  for i in range(len(step_gmems))]
    return [smem_spec((cta_m, tile_k), lambda kk: (0, kk), transforms=transforms, **a_shared), b_spec, *step_specs]


def _lowrank_smem(plgpu, la_gmem, *, config: TileConfig, b_layout: str):
    """SMEM for the low-rank slices: wgmma takes one swizzle for both operands and K steps of swizzle / itemsize, so
    both are swizzled by the rank's row width (R = 16 at 16 bits: 32 bytes, one K step of the instruction). The
    slice both warpgroups read (lb's columns when they split M, la's rows when they split N) is held once, loaded by
    warpgroup 0; each warpgroup holds its own slice of the other factor."""
    tile_m, tile_n = config.tile_m, config.tile_n
    rank, lr_dtype = la_gmem.shape[1], la_gmem.dtype
    lr_transforms = _smem_transforms(plgpu, rank, lr_dtype)
    la_slots, lb_slots = (2, 1) if config.wg_split == "m" else (1, 2)
    lb_shape = (lb_slots, tile_n, rank) if b_layout == "nk" else (lb_slots, rank, tile_n)
    return (plgpu.SMEM((la_slots, tile_m, rank), lr_dtype, transforms=lr_transforms),
            plgpu.SMEM(lb_shape, lr_dtype, transforms=lr_transforms))


def _tile_index(plgpu, lin, m_iters: int, n_iters: int, config: TileConfig):
    """(m, n) index of the CTA's output tile at position `lin` of the persistent walk: a planar snake over the
    (cluster) tiles, so that consecutive CTAs share operand tiles in L2; with a cluster each CTA takes its half."""
    minor = 1 if config.grid_minor_dim == "n" else 0  # planar_snake's minor_dim: 0 = M, 1 = N
    m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), minor, config.grid_tile_width)
    if config.cluster == "m":
        m_idx = 2 * m_idx + lax.axis_index("cluster")
    elif config.cluster == "n":
        n_idx = 2 * n_idx + lax.axis_index("cluster")
    return m_idx, n_idx


def _fetch_vec_slices(vec_gmems, sliced, n_rows: int, row0, col0, tile_m: int, tile_n: int, vec_smem, vec_barrier,
                      wg):
    """TMA-copy the warpgroup's slices of the sliced row / column vectors into SMEM, each under its own barrier
    (vec_barrier[COMPUTE_WGS * j + wg]), when its tile starts: issued before the main loop, so the copies overlap it
    and the epilogue (`_epilogue_vecs`) waits for them only at the end."""
    plgpu = _backend.mosaic_gpu()
    for j, i in enumerate(sliced):
        window = pl.ds(row0, tile_m) if i < n_rows else pl.ds(col0, tile_n)
        plgpu.copy_gmem_to_smem(vec_gmems[i].at[window], vec_smem[j].at[wg], vec_barrier.at[COMPUTE_WGS * j + wg])


def _store_through_smem(out, out_smem, wg, epi: int, tile_m: int, tile_n: int, dst, transpose_out: bool = False):
    """Store the warpgroup's epilogue tile `out` (already in the result dtype) through its two (epi, epi) SMEM slots:
    each piece written into SMEM, then TMA-stored to dst(rows, cols) (the piece's global window), alternating slots
    so that a piece's store overlaps the next piece's write. The first wait: the warpgroup's previous tile's stores
    have left out_smem. With `transpose_out` each piece goes into SMEM transposed (stmatrix.trans) and dst takes
    (cols, rows)."""
    plgpu = _backend.mosaic_gpu()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    slot = 0
    for ei in range(tile_m // epi):
        for ej in range(tile_n // epi):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            piece = out[ei * epi:(ei + 1) * epi, ej * epi:(ej + 1) * epi]
            rows, cols = pl.ds(ei * epi, epi), pl.ds(ej * epi, epi)
            if transpose_out:
                piece = plgpu.layout_cast(piece, plgpu.Layout.WGMMA_TRANSPOSED)
                out_smem.at[wg, slot].transpose((1, 0))[...] = piece
                target = dst(cols, rows)
            else:
                out_smem[wg, slot] = piece
                target = dst(rows, cols)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], target)
            slot = 1 - slot


def _kernel(a_gmem, b_gmem, *refs, config: TileConfig, b_layout: str, n_rows: int, n_vecs: int, n_step_rows: int,
            epilogue: Epilogue, promote: Promote | None, uniform_steps: tuple[bool, bool], a_dequant: Dequant | None,
            lowrank: bool, transpose_out: bool):
    """The cooperative schedule (module docstring): the pipeline's memory warpgroup streams the CTA tile's K steps
    (`_pipeline_specs`), both compute warpgroups run every K step's wgmma on their half (`mma_body`), then each runs
    the epilogue on its fp32 tile and stores it (`store`)."""
    plgpu = _backend.mosaic_gpu()
    *vec_gmems, out_gmem = refs
    la_gmem = lb_gmem = None
    if lowrank:
        *vec_gmems, la_gmem, lb_gmem = vec_gmems
    vec_gmems, step_gmems = vec_gmems[:n_vecs], vec_gmems[n_vecs:]
    # A (1,) vector is one value for every row (column): read once per kernel as a scalar, no per-tile copy. The
    # others are sliced per tile into SMEM, each under its own barrier per warpgroup.
    sliced = [i for i, v in enumerate(vec_gmems) if v.shape != (1,)]
    m, k = a_gmem.shape
    n = out_gmem.shape[0 if transpose_out else 1]
    out_dtype = out_gmem.dtype
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n = config.cta_tile
    clu_m, clu_n = config.cluster_tile
    m_iters, n_iters, k_iters = m // clu_m, n // clu_n, k // tile_k
    epi = config.epi_tile
    out_transforms = _smem_transforms(plgpu, epi, out_dtype)
    split_m = config.wg_split == "m"
    early = config.early_release and promote is not None
    in_specs = _pipeline_specs(plgpu, a_gmem, b_gmem, step_gmems, config=config, b_layout=b_layout,
                               n_step_rows=n_step_rows)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
            manual_consumed_barriers=early,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the allocations
    vec_smem = tuple(plgpu.SMEM((2, tile_m if i < n_rows else tile_n), vec_gmems[i].dtype) for i in sliced)
    n_barriers = 2 * len(sliced) + (3 if lowrank else 0)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, *step_gmems),
        out_smem=plgpu.SMEM((2, 2, epi, epi), out_dtype, transforms=out_transforms),
        vec_smem=vec_smem,
        # One per warpgroup and sliced vector, then (with the low-rank step) one per warpgroup for its own low-rank
        # slice and one for the shared slice.
        vec_barrier=plgpu.Barrier(num_barriers=n_barriers) if n_barriers else None,
        lr_smem=_lowrank_smem(plgpu, la_gmem, config=config, b_layout=b_layout) if lowrank else None,
        # Both warpgroups arrive once they have read the shared low-rank slice, so warpgroup 0 overwrites it with
        # the next tile's only then.
        shared_free=plgpu.Barrier(num_arrivals=2) if lowrank else None,
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, vec_smem, vec_barrier, lr_smem, shared_free):
        wg = lax.axis_index("wg")
        scalars = {i: v[0].astype(jnp.float32) for i, v in enumerate(vec_gmems) if i not in sliced}
        if lowrank:
            @pl.when(wg < COMPUTE_WGS)  # not the pipeline's memory warpgroup (the last): the shared slot starts free
            def _():
                plgpu.barrier_arrive(shared_free)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(loop_info):
            (lin,) = getattr(loop_info, "index", loop_info)
            m_idx, n_idx = _tile_index(plgpu, lin, m_iters, n_iters, config)
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            cta_n_slice = pl.ds(n_idx * cta_n, cta_n)
            wg_row = wg * tile_m if split_m else 0  # the warpgroup's first row and column in the CTA tile
            wg_col = 0 if split_m else wg * tile_n
            wg_m, wg_n = pl.ds(wg_row, tile_m), pl.ds(wg_col, tile_n)
            row0, col0 = m_idx * cta_m + wg_row, n_idx * cta_n + wg_col

            def store(acc):
                """epilogue() of the warpgroup's fp32 tile, stored through SMEM."""
                vecs = _epilogue_vecs(len(vec_gmems), n_rows, scalars, sliced, vec_smem, vec_barrier, wg)
                out = epilogue(acc, vecs[:n_rows], vecs[n_rows:]).astype(out_dtype)
                if transpose_out:
                    dst = lambda cols, rows: out_gmem.at[cta_n_slice, cta_m_slice].at[wg_n, wg_m].at[cols, rows]  # noqa: E731
                else:
                    dst = lambda rows, cols: out_gmem.at[cta_m_slice, cta_n_slice].at[wg_m, wg_n].at[rows, cols]  # noqa: E731
                _store_through_smem(out, out_smem, wg, epi, tile_m, tile_n, dst, transpose_out)

            def compute_context(eval_pipeline):
                # Fetch this warpgroup's vector slices (and low-rank slices) while the main loop runs.
                _fetch_vec_slices(vec_gmems, sliced, n_rows, row0, col0, tile_m, tile_n, vec_smem, vec_barrier, wg)
                if lowrank:
                    lr = _fetch_lowrank(la_gmem, lb_gmem, lr_smem, vec_barrier, shared_free, wg, row0, col0,
                                        first=2 * len(sliced), config=config, b_layout=b_layout)
                if promote is None:
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        if lowrank:
                            _lowrank_mma(acc_ref, *lr, shared_free, b_layout=b_layout)
                        store(acc_ref[...])
                else:
                    store(eval_pipeline(jnp.zeros((tile_m, tile_n), jnp.float32)))

            def mma_body(_, a_smem, b_smem, *rest):
                step_smems, consumed, carry = rest[:len(step_gmems)], rest[len(step_gmems):-1], rest[-1]
                return _mma_step(carry, a_smem, b_smem, step_smems, consumed, wg_row, wg_col, config=config,
                                 b_layout=b_layout, b_dtype=b_gmem.dtype, n_step_rows=n_step_rows, promote=promote,
                                 uniform_steps=uniform_steps, a_dequant=a_dequant)

            b_view = b_gmem.at[cta_n_slice, :] if b_layout == "nk" else b_gmem.at[:, cta_n_slice]
            step_views = [v.at[:, cta_m_slice if i < n_step_rows else cta_n_slice] for i, v in enumerate(step_gmems)]
            get_pipeline(mma_body, compute_context)(a_gmem.at[cta_m_slice, :], b_view, *step_views,
                                                    allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _mma_step(carry, a_smem, b_smem, step_smems, consumed, wg_row, wg_col, *, config: TileConfig, b_layout: str,
              b_dtype, n_step_rows: int, promote: Promote | None, uniform_steps: tuple[bool, bool],
              a_dequant: Dequant | None):
    """One K step of a compute warpgroup in the cooperative schedule: its wgmma on its half of the stage's tiles (a's
    rows from wg_row, b's columns from wg_col), into the accumulator ref `carry`; or, with `promote`, into a fresh
    step accumulator whose product is promoted with the step's scales into the running fp32 sum `carry` (returned).
    The stage is released (`consumed`, with early_release) once its scales are in registers."""
    plgpu = _backend.mosaic_gpu()
    tile_m, tile_n = config.tile_m, config.tile_n
    wg_m, wg_n = pl.ds(wg_row, tile_m), pl.ds(wg_col, tile_n)
    b_wg = b_smem.at[wg_n] if b_layout == "nk" else b_smem.at[:, wg_n]
    b_tile = b_wg.transpose((1, 0)) if b_layout == "nk" else b_wg
    a_tile = a_smem.at[wg_m]
    if a_dequant is not None:
        # a's stored tile loaded (in the layout Mosaic GPU infers for wgmma's register A operand), converted in
        # registers and fed to wgmma from there: no shared-memory round trip.
        a_tile = a_dequant(a_tile[...]).astype(b_dtype)
    if promote is None:
        plgpu.wgmma(carry, a_tile, b_tile)
        plgpu.wgmma_wait(0)
        return carry

    def step_scales():
        """The K step's row and column scales of the warpgroup's tile, fp32 in WGMMA layouts."""
        rows = [v[0, wg_row] if uniform_steps[0] else
                _backend.mosaic_load(v.at[0, wg_m], layout=plgpu.Layout.WGMMA.reduce(1))
                for v in step_smems[:n_step_rows]]
        cols = [v[0, wg_col] if uniform_steps[1] else
                _backend.mosaic_load(v.at[0, wg_n], layout=plgpu.Layout.WGMMA.reduce(0))
                for v in step_smems[n_step_rows:]]
        return [r.astype(jnp.float32) for r in rows], [c.astype(jnp.float32) for c in cols]

    def release():  # the stage's tiles are no longer read: its scales are in registers
        for barrier in consumed:
            plgpu.barrier_arrive(barrier)

    # The step accumulator is a fresh zeroed allocation (what wgmma accumulates onto).
    def step(step_ref):
        plgpu.wgmma(step_ref, a_tile, b_tile)
        scales = step_scales()  # loaded while the wgmma runs
        product = step_ref[...]  # waits for it
        release()
        return carry + promote(product, *scales)

    return pl.run_scoped(step, plgpu.ACC((tile_m, tile_n), jnp.float32))


def _fetch_lowrank(la_gmem, lb_gmem, lr_smem, vec_barrier, shared_free, wg, row0, col0, *, first: int,
                   config: TileConfig, b_layout: str):
    """TMA-copy the warpgroup's low-rank slices into SMEM while the main loop runs: its own slice of one factor under
    its own barrier (vec_barrier[first + wg]), and (by warpgroup 0, once both warpgroups are done with the last
    tile's) the slice both read under vec_barrier[first + 2]. Returns (la_slot, lb_slot, la_bar, lb_bar) for
    `_lowrank_mma`."""
    plgpu = _backend.mosaic_gpu()
    tile_m, tile_n = config.tile_m, config.tile_n
    split_m = config.wg_split == "m"
    la_smem, lb_smem = lr_smem
    own_bar, shared_bar = vec_barrier.at[first + wg], vec_barrier.at[first + 2]  # both wait on it
    la_bar, lb_bar = (own_bar, shared_bar) if split_m else (shared_bar, own_bar)
    la_slot, lb_slot = la_smem.at[wg if split_m else 0], lb_smem.at[0 if split_m else wg]
    la_src = la_gmem.at[pl.ds(row0, tile_m), :]
    lb_src = (lb_gmem.at[pl.ds(col0, tile_n), :] if b_layout == "nk"
              else lb_gmem.at[:, pl.ds(col0, tile_n)])
    la, lb = (la_src, la_slot, la_bar), (lb_src, lb_slot, lb_bar)
    own, shared = (la, lb) if split_m else (lb, la)
    plgpu.copy_gmem_to_smem(*own)

    @pl.when(wg == 0)
    def _():
        plgpu.barrier_wait(shared_free)  # both warpgroups are done with the last tile's
        plgpu.copy_gmem_to_smem(*shared)

    return la_slot, lb_slot, la_bar, lb_bar


def _lowrank_mma(acc_ref, la_slot, lb_slot, la_bar, lb_bar, shared_free, *, b_layout: str):
    """The low-rank step: one more wgmma, la's slice @ lb's, into the accumulator after the main loop. The next
    tile's copy into this warpgroup's own slice is issued by it after the wait, into the shared one by warpgroup 0
    once both have arrived on `shared_free` here, so neither races the read."""
    plgpu = _backend.mosaic_gpu()
    plgpu.barrier_wait(la_bar)
    plgpu.barrier_wait(lb_bar)
    lb_tile = lb_slot.transpose((1, 0)) if b_layout == "nk" else lb_slot
    plgpu.wgmma(acc_ref, la_slot, lb_tile)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(shared_free)


def _epilogue_vecs(n_vecs: int, n_rows: int, scalars, sliced, vec_smem, vec_barrier, wg):
    """The epilogue's row then column vectors for warpgroup `wg`'s tile: each a scalar read once (`scalars`), or the
    warpgroup's slice in SMEM once its copy (vec_barrier[COMPUTE_WGS * j + wg] for the j-th of `sliced`) landed,
    in the WGMMA layout along its axis."""
    plgpu = _backend.mosaic_gpu()
    vecs = []
    for i in range(n_vecs):
        if i in scalars:
            vecs.append(scalars[i])
            continue
        j = sliced.index(i)
        plgpu.barrier_wait(vec_barrier.at[COMPUTE_WGS * j + wg])
        vecs.append(_backend.mosaic_load(vec_smem[j].at[wg], layout=plgpu.Layout.WGMMA.reduce(1 if i < n_rows else 0))
                    .astype(jnp.float32))
    return vecs


def _pingpong_kernel(a_gmem, b_gmem, *refs, config: TileConfig, b_layout: str, n_rows: int, epilogue: Epilogue,
                     num_ctas: int):
    """The ping-pong schedule (module docstring): warpgroup w computes and stores every other tile of the CTA's
    walk (`_pingpong_consumer`), the memory warpgroup (the last) loads the K steps of all of them in walk order
    (`_pingpong_producer`). With a cluster the walk is over cluster tiles, each CTA taking its half, and both CTAs'
    j-th tiles belong to the same warpgroup, so the operand they share is one multicast load into both rings each K
    step."""
    plgpu = _backend.mosaic_gpu()
    *vec_gmems, out_gmem = refs
    sliced = [i for i, v in enumerate(vec_gmems) if v.shape != (1,)]
    m, k = a_gmem.shape
    n = out_gmem.shape[1]
    out_dtype = out_gmem.dtype
    tile_m, tile_n, tile_k, epi = config.tile_m, config.tile_n, config.tile_k, config.epi_tile
    stages = config.max_concurrent_steps
    clu_m, clu_n = config.cluster_tile
    m_iters, n_iters, k_iters = m // clu_m, n // clu_n, k // tile_k
    nk = b_layout == "nk"
    # A stage is refilled once its owner has read it in every CTA it is loaded into: with a cluster, the shared
    # operand's multicast writes the peer's ring too, so both CTAs' owners arrive on both CTAs' barriers.
    consumed = (plgpu.ClusterBarrier(collective_axes=("cluster",), num_barriers=stages) if config.cluster
                else plgpu.Barrier(num_barriers=stages))
    b_shape = (stages, tile_n, tile_k) if nk else (stages, tile_k, tile_n)

    @functools.partial(
        pl.run_scoped,
        a_ring=plgpu.SMEM((stages, tile_m, tile_k), a_gmem.dtype,
                          transforms=_smem_transforms(plgpu, tile_k, a_gmem.dtype)),
        b_ring=plgpu.SMEM(b_shape, b_gmem.dtype,
                          transforms=_smem_transforms(plgpu, tile_k if nk else tile_n, b_gmem.dtype)),
        # full[w * stages + s]: stage s holds a K step of warpgroup w's tile (a's and b's copies each arrive).
        full=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS * stages),
        consumed=consumed,
        turn=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        out_smem=plgpu.SMEM((COMPUTE_WGS, 2, epi, epi), out_dtype, transforms=_smem_transforms(plgpu, epi, out_dtype)),
        vec_smem=tuple(plgpu.SMEM((COMPUTE_WGS, tile_m if i < n_rows else tile_n), vec_gmems[i].dtype)
                       for i in sliced),
        vec_barrier=plgpu.Barrier(num_barriers=COMPUTE_WGS * len(sliced)) if sliced else None,
        collective_axes="wg",
    )
    def _scope(a_ring, b_ring, full, consumed, turn, out_smem, vec_smem, vec_barrier):
        wg, cta = lax.axis_index("wg"), lax.axis_index("sm")
        tiles = m_iters * n_iters
        # The CTA's tiles are cta, cta + num_ctas, ... (local index j): as many as fit below `tiles`.
        local_tiles = tiles // num_ctas + (cta < tiles % num_ctas).astype(jnp.int32)

        def origin(j):
            """The first row and column of the CTA's j-th tile."""
            m_idx, n_idx = _tile_index(plgpu, cta + j * num_ctas, m_iters, n_iters, config)
            return m_idx * tile_m, n_idx * tile_n

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            _pingpong_producer(a_gmem, b_gmem, a_ring, b_ring, full, consumed, origin, local_tiles, config=config,
                               nk=nk)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(_compute_registers(), action="increase")
            scalars = {i: v[0].astype(jnp.float32) for i, v in enumerate(vec_gmems) if i not in sliced}

            def tile(i, carry):
                j = COMPUTE_WGS * i + wg  # the CTA's j-th tile is this warpgroup's i-th
                row0, col0 = origin(j)
                _fetch_vec_slices(vec_gmems, sliced, n_rows, row0, col0, tile_m, tile_n, vec_smem, vec_barrier, wg)

                @pl.when(j > 0)  # the previous tile's (the other warpgroup's) main loop has been issued
                def _():
                    plgpu.barrier_wait(turn.at[wg])

                first = j * k_iters  # the ring's count of K steps before this tile's

                def main_loop(acc_ref):
                    _pingpong_mma_loop(acc_ref, a_ring, b_ring, full, consumed, turn, wg, first=first,
                                       k_iters=k_iters, stages=stages, nk=nk)
                    store(acc_ref[...], row0, col0)

                pl.run_scoped(main_loop, plgpu.ACC((tile_m, tile_n), jnp.float32))
                return carry

            def store(acc, row0, col0):
                """epilogue() of the warpgroup's fp32 tile, stored through SMEM."""
                vecs = _epilogue_vecs(len(vec_gmems), n_rows, scalars, sliced, vec_smem, vec_barrier, wg)
                out = epilogue(acc, vecs[:n_rows], vecs[n_rows:]).astype(out_dtype)
                dst_tile = out_gmem.at[pl.ds(row0, tile_m), pl.ds(col0, tile_n)]
                _store_through_smem(out, out_smem, wg, epi, tile_m, tile_n, lambda rows, cols: dst_tile.at[rows, cols])

            own_tiles = (local_tiles + COMPUTE_WGS - 1 - wg) // COMPUTE_WGS
            lax.fori_loop(0, own_tiles, tile, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pingpong_producer(a_gmem, b_gmem, a_ring, b_ring, full, consumed, origin, local_tiles, *, config: TileConfig,
                       nk: bool):
    """The memory warpgroup of the ping-pong schedule: TMA-loads every K step of every tile of the CTA's walk, in walk
    order, into the next stage of the one ring both compute warpgroups share, arriving on the owner's "full" barrier
    of that stage (a stage is reused only once its previous K step has been released). Then it waits for the last
    releases, so that no arrival is still on its way to a barrier when the CTA exits."""
    plgpu = _backend.mosaic_gpu()
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    stages = config.max_concurrent_steps
    k_iters = a_gmem.shape[1] // tile_k
    a_shared = dict(collective_axes="cluster") if config.cluster == "n" else {}
    b_shared = dict(collective_axes="cluster") if config.cluster == "m" else {}
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    def tile(j, step):
        row0, col0 = origin(j)
        owner = lax.rem(j, COMPUTE_WGS)

        def k_step(kk, step):
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)  # the stage's previous K step has been read
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            ks = pl.ds(kk * tile_k, tile_k)
            barrier = full.at[owner * stages + slot]
            plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(row0, tile_m), ks], a_ring.at[slot], barrier, **a_shared)
            b_src = b_gmem.at[pl.ds(col0, tile_n), ks] if nk else b_gmem.at[ks, pl.ds(col0, tile_n)]
            plgpu.copy_gmem_to_smem(b_src, b_ring.at[slot], barrier, **b_shared)
            return step + 1

        return lax.fori_loop(0, k_iters, k_step, step)

    steps = lax.fori_loop(0, local_tiles, tile, jnp.int32(0))

    def drain(step, carry):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])
        return carry

    lax.fori_loop(lax.max(steps - stages, 0), steps, drain, None)


def _pingpong_mma_loop(acc_ref, a_ring, b_ring, full, consumed, turn, wg, *, first, k_iters: int, stages: int,
                       nk: bool):
    """A compute warpgroup's main loop over its tile's K steps (the ring's K steps from `first`, its count of K steps
    before this tile's, on): wait for the stage's loads, issue its wgmma, and release the previous step's stage once
    that wgmma is done (one wgmma stays in flight, so a stage is released a K step late). After the last step it
    lets the other warpgroup's main loop start (its wgmmas queue behind this one's last), waits for its own and
    releases the last stage."""
    plgpu = _backend.mosaic_gpu()

    def k_step(kk, carry):
        slot = lax.rem(first + kk, stages)
        plgpu.barrier_wait(full.at[wg * stages + slot])
        b_tile = b_ring.at[slot].transpose((1, 0)) if nk else b_ring.at[slot]
        plgpu.wgmma(acc_ref, a_ring.at[slot], b_tile)
        plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its stage is free

        @pl.when(kk > 0)
        def _():
            plgpu.barrier_arrive(consumed.at[lax.rem(first + kk + stages - 1, stages)])

        return carry

    lax.fori_loop(0, k_iters, k_step, None)
    plgpu.barrier_arrive(turn.at[1 - wg])  # the other warpgroup's wgmmas queue behind the last one
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(consumed.at[lax.rem(first + k_iters - 1, stages)])


MEMORY_REGISTERS = 40  # per thread of the memory warpgroup, as the cooperative pipeline gives it


def _compute_registers() -> int:
    """Per thread of each compute warpgroup: the rest of the SM's 64 Ki registers (512 per thread of one warpgroup),
    rounded down to a multiple of 8 (setmaxnreg's granularity)."""
    return min(256, (512 - MEMORY_REGISTERS) // COMPUTE_WGS) // 8 * 8


SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may allocate on sm90


def smem_bytes(config: TileConfig, a_itemsize: int, b_itemsize: int, out_itemsize: int, rank: int = 0,
               lowrank_itemsize: int = 2) -> int:
    """Shared memory of one CTA (the ring, the epilogue staging and the low-rank slices; the vector slices and the
    barriers take under 2 KiB more). A cluster changes none of it: each CTA holds its whole a and b tiles, one of
    them written by the other CTA's multicast."""
    cta_m, cta_n = config.cta_tile
    ring = config.max_concurrent_steps * config.tile_k * (cta_m * a_itemsize + cta_n * b_itemsize)
    out = 2 * 2 * config.epi_tile * config.epi_tile * out_itemsize
    # the low-rank slices: each warpgroup's own, and the one both read once (see `_kernel`)
    return ring + out + rank * (cta_m + cta_n) * lowrank_itemsize


def supported(m: int, n: int, k: int, config: TileConfig) -> bool:
    """Whether the kernel runs these shapes as they are (no padding): multiples of the cluster tile (the CTA tile
    without a cluster) and tile_k."""
    tm, tn = config.cluster_tile
    return m % tm == 0 and n % tn == 0 and k % config.tile_k == 0


def matmul(a, b, *, b_layout: str, row_vecs: Sequence[jax.Array] = (), col_vecs: Sequence[jax.Array] = (),
           epilogue: Epilogue, out_dtype, config: TileConfig, name: str, step_row_vecs: Sequence[jax.Array] = (),
           step_col_vecs: Sequence[jax.Array] = (), promote: Promote | None = None,
           uniform_steps: tuple[bool, bool] = (False, False), a_dequant: Dequant | None = None,
           lowrank: tuple[jax.Array, jax.Array] | None = None, transpose_out: bool = False, interpret: bool = False):
    """epilogue(a @ b, row_vecs, col_vecs) on Hopper; a (M, K), b (K, N) or (N, K) per `b_layout` ("kn" | "nk").
    row_vecs are (M,) or (1,) (one value for every row: the epilogue gets an fp32 scalar), col_vecs (N,) or (1,).

    With `promote`, a @ b is replaced by the sum over K steps s of promote(a_s @ b_s, [v[s] for v in
    step_row_vecs], [v[s] for v in step_col_vecs]), each step's product and the sum in fp32 (module docstring);
    step row vectors are (K / tile_k, M), step column vectors (K / tile_k, N). uniform_steps = (rows, columns):
    the caller's promise that each step row (column) vector is constant over every warpgroup's tile_m rows
    (tile_n columns), as block scales are: the kernel then reads one scalar of it per step and promote gets
    that fp32 scalar instead of a vector (the scale product is then one multiply per row, not per element).
    With `a_dequant`, a is stored in another dtype (int8 / uint8, (M, K) K-major) and each step's a tile is
    a_dequant(stored tile), converted to b's 16-bit dtype, in registers: wgmma's A operand straight from there
    (module docstring).
    transpose_out: the result is stored transposed, (N, M) (16-bit out_dtype); the epilogue still sees (M, N) tiles.
    lowrank = (la, lb): la @ lb is added to the fp32 accumulator before the epilogue (not with `promote`); la (M, R),
    lb (R, N) ("kn") or (N, R) ("nk"), one 16-bit dtype (a's where a is 16-bit), R a multiple of 16 (pad the rank
    with zeros).
    `name` names the kernel in profiles. Under vmap the batch runs as a loop of launches (no batching rule).
    interpret=True runs the kernel in Mosaic GPU's interpret mode on the CPU (jax >= 0.12; slow, for tests).
    """
    plgpu = _backend.mosaic_gpu()
    if b_layout not in ("kn", "nk"):
        raise ValueError(f"{name}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    if config.cluster not in (None, "m", "n"):
        raise ValueError(f"{name}: config.cluster must be None, 'm' or 'n', got {config.cluster!r}")
    if config.schedule not in ("cooperative", "pingpong"):
        raise ValueError(f"{name}: config.schedule must be 'cooperative' or 'pingpong', got {config.schedule!r}")
    pingpong = config.schedule == "pingpong"
    if pingpong:
        unsupported = [what for what, used in (("promote", promote is not None), ("a_dequant", a_dequant is not None),
                                               ("lowrank", lowrank is not None), ("transpose_out", transpose_out))
                       if used]
        if unsupported:
            raise ValueError(f"{name}: the 'pingpong' schedule supports row and column vectors only, not "
                             f"{', '.join(unsupported)}")
    if a_dequant is not None:
        if jnp.dtype(b.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(f"{name}: with a_dequant, b must be bfloat16 or float16 (a's tiles are converted to its "
                             f"dtype), got {b.dtype}")
    elif b_layout == "kn" and jnp.dtype(b.dtype).itemsize < 2:
        raise ValueError(f"{name}: wgmma reads {b.dtype} operands only K-major: pass b as (N, K) with b_layout='nk'")
    if transpose_out and jnp.dtype(out_dtype).itemsize != 2:
        raise ValueError(f"{name}: transpose_out stores 16-bit tiles transposed; out_dtype {out_dtype} is not 16-bit")
    m, k = a.shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    if not supported(m, n, k, config):
        raise ValueError(f"{name}: shapes {a.shape} x {b.shape} ({b_layout}) must be multiples of the tile "
                         f"{config.cluster_tile + (config.tile_k,)}")
    for kind, vecs, want in (("row_vecs", row_vecs, m), ("col_vecs", col_vecs, n)):
        for v in vecs:
            if v.shape not in ((want,), (1,)):
                raise ValueError(f"{name}: each of {kind} must have shape ({'M' if want == m else 'N'},) = ({want},) "
                                 f"or (1,), got {v.shape}")
    if (step_row_vecs or step_col_vecs) and promote is None:
        raise ValueError(f"{name}: step_row_vecs / step_col_vecs need a promote function")
    for kind, vecs, want in (("step_row_vecs", step_row_vecs, m), ("step_col_vecs", step_col_vecs, n)):
        for v in vecs:
            if v.shape != (k // config.tile_k, want):
                raise ValueError(f"{name}: each of {kind} must have shape (K / tile_k, {'M' if want == m else 'N'}) = "
                                 f"{(k // config.tile_k, want)}, got {v.shape}")
    rank = 0
    if lowrank is not None:
        if promote is not None:
            raise ValueError(f"{name}: lowrank is not supported with promote (its sum is not an accumulator ref)")
        _check_lowrank(lowrank, a, m, n, b_layout, name)
        rank = lowrank[0].shape[1]
    out_itemsize = jnp.dtype(out_dtype).itemsize
    need = smem_bytes(config, a.dtype.itemsize, b.dtype.itemsize, out_itemsize, rank,
                      lowrank[0].dtype.itemsize if rank else 2)
    if need > SMEM_LIMIT:
        raise ValueError(f"{name}: config {config} needs {need} bytes of shared memory (rank {rank}), more than the "
                         f"{SMEM_LIMIT} one CTA may use: lower max_concurrent_steps or tile_k")

    if a_dequant is not None and interpret:
        # Mosaic GPU's interpret mode takes wgmma operands from SMEM only: there a is converted whole by XLA and
        # the kernel runs its 16-bit path (its lowering of the register operand is checked for the GPU apart).
        a, a_dequant = a_dequant(a).astype(b.dtype), None

    num_ctas = max(1, _backend.num_sms() // (2 if config.cluster else 1))

    def body(*refs):
        if pingpong:
            _pingpong_kernel(*refs, config=config, b_layout=b_layout, n_rows=len(row_vecs), epilogue=epilogue,
                             num_ctas=num_ctas)
            return
        _kernel(*refs, config=config, b_layout=b_layout, n_rows=len(row_vecs), n_vecs=len(row_vecs) + len(col_vecs),
                n_step_rows=len(step_row_vecs), epilogue=epilogue, promote=promote, uniform_steps=uniform_steps,
                a_dequant=a_dequant, lowrank=lowrank is not None, transpose_out=transpose_out)

    body.__name__ = body.__qualname__ = name  # the kernel's name in profiles
    # One CTA per SM; with a cluster the grid counts clusters (of two CTAs, on two SMs).
    cluster = dict(cluster=(2,), cluster_names=("cluster",)) if config.cluster else {}
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n, m) if transpose_out else (m, n), out_dtype),
        grid=(num_ctas,),
        grid_names=("sm",),
        **cluster,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **(dict(interpret=_backend.mosaic_interpret(name)) if interpret else {}),
    )
    return jax.custom_batching.sequential_vmap(kernel)(a, b, *row_vecs, *col_vecs, *step_row_vecs, *step_col_vecs,
                                                       *(lowrank or ()))


def _check_lowrank(lowrank, a, m: int, n: int, b_layout: str, name: str):
    if not isinstance(lowrank, (tuple, list)) or len(lowrank) != 2:
        raise ValueError(f"{name}: lowrank must be a pair (la, lb), got {type(lowrank).__name__}")
    la, lb = lowrank
    if la.ndim != 2 or la.shape[0] != m or la.shape[1] % 16 or la.shape[1] == 0:
        raise ValueError(f"{name}: lowrank la must have shape (M, R) = ({m}, R) with R a positive multiple of 16 "
                         f"(pad the rank with zeros), got {la.shape}")
    rank = la.shape[1]
    want = (rank, n) if b_layout == "kn" else (n, rank)
    if lb.shape != want:
        raise ValueError(f"{name}: lowrank lb must have shape {want} ({'(R, N)' if b_layout == 'kn' else '(N, R)'}, "
                         f"b_layout {b_layout!r}), got {lb.shape}")
    if jnp.dtype(la.dtype).itemsize != 2 or not jnp.issubdtype(la.dtype, jnp.floating) or lb.dtype != la.dtype:
        raise ValueError(f"{name}: lowrank la and lb must share a 16-bit float dtype, got {la.dtype} and {lb.dtype}")
    if jnp.dtype(a.dtype).itemsize == 2 and la.dtype != a.dtype:
        raise ValueError(f"{name}: lowrank la must be in a's dtype {a.dtype}, got {la.dtype}")
