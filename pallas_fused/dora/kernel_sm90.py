"""DoRA's (and LoRA's) GEMMs on Hopper, one Mosaic GPU kernel each way, W never merged with the adapters:

  forward  y  = (x W + (x A) (s B)) g + bias     the low-rank product in the same fp32 accumulator (the sm90
                                                 skeleton's low-rank step), g and the bias in the epilogue;
  backward dx = (dy g) W^T + ((dy g) (s B)^T) A^T  W read as (N, K) ("nk"), the low-rank step on A (K, R).

g = m / ||W + s A B|| comes from the column norm's read-only pass (kernel_norm), so the bytes DoRA adds to the base
GEMM are one read of W (the norm) and one of x (x A); LoRA (g = 1) adds only x A. cuBLAS can neither scale
columns in its epilogue nor add a second product, which is why the cuBLAS paths ("merged") form (W + s A B) g.

The GEMM is the shared sm90 skeleton (pallas_fused/_sm90.py) with 16-bit operands: x (M, K) K-major, W (K, N)
N-major (wgmma reads 16-bit B tiles in either major order, so neither direction needs a transpose of W).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fused import _backend, _sm90, _tuning

# Tile configurations by output size: "large", and "small" where large leaves SMs idle. A GPU without a tuning table
# gets the H200's (Hopper parts share the SM design; the measurements: docs/performance.md, "Tuning tables").
# "max_rank": the largest (padded) adapter rank for which plain "pallas" picks "sm90": the low-rank slices take
# shared memory from the ring (`fit_lowrank`), and at rank 64 the shrunk ring loses to cuBLAS on the merged weight.
HEURISTIC = {"large": dict(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=2),
             "small": dict(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=5), "max_rank": 16}


def max_rank() -> int:
    """The largest padded rank plain "pallas" runs as "sm90" on this device kind (tuning data)."""
    return int(_backend.tuned("dora_sm90", HEURISTIC)["max_rank"])


def tiles() -> tuple[_sm90.TileConfig, _sm90.TileConfig]:
    """(large, small) for this device kind (pallas_fused/tuning/<device>.json, else HEURISTIC)."""
    table = _backend.tuned("dora_sm90", HEURISTIC)
    return _sm90.TileConfig(**table["large"]), _sm90.TileConfig(**table["small"])


def config_for(m: int, n: int, k: int, rank: int = 0, itemsize: int = 2) -> _sm90.TileConfig:
    """The tile configuration for an (m, k) x (k, n) product (large unless it leaves SMs idle), with room in shared
    memory for a rank-`rank` low-rank step (`fit_lowrank`)."""
    large, small = tiles()
    cta_m, cta_n = large.cta_tile
    config = small if -(-m // cta_m) * -(-n // cta_n) < _backend.num_sms() else large
    return fit_lowrank(config, rank, itemsize)


def _smem(config: _sm90.TileConfig, rank: int, itemsize: int, int8_a: bool = False) -> int:
    """Shared memory of a DoRA GEMM: the 16-bit operand, the output and the low-rank slices in `itemsize` bytes, the
    other operand too or (`int8_a`, QDoRA's int8 W as a) one byte."""
    return _sm90.smem_bytes(config, 1 if int8_a else itemsize, itemsize, itemsize, rank, itemsize)


def fit_lowrank(config: _sm90.TileConfig, rank: int, itemsize: int = 2, int8_a: bool = False) -> _sm90.TileConfig:
    """`config` with its ring shrunk until the low-rank slices ((cta_m + cta_n) R 16-bit items, `_sm90.smem_bytes`) fit
    beside it: fewer stages first, then half the K step with twice the stages (the same K depth in flight), never
    under 2 stages. The large tiles (128 x 128 x 128, 2 stages) fill shared memory on their own; at rank 16 they
    become 128 x 128 x 64 x 3 stages. `int8_a`: QDoRA's int8 ring (`_smem`)."""
    def fits(c):
        return _smem(c, rank, itemsize, int8_a) <= _sm90.SMEM_LIMIT

    tile_k, depth = config.tile_k, config.tile_k * config.max_concurrent_steps
    while tile_k >= 64:
        for steps in range(max(2, depth // tile_k), 1, -1):
            c = dataclasses.replace(config, tile_k=tile_k, max_concurrent_steps=steps)
            if fits(c):
                return c
        tile_k //= 2
    return config  # nothing fits: `_sm90.matmul` names the shortfall


# ----------------------------------------------------------------------------------------------
# a layer's two GEMMs: the rule's tiles, the tuned ones (`pallas_fused.tune`), the candidates

LAYER_OP = "dora_sm90"  # the tuning tables' op (their "shapes"): a dense layer's variant, and "sm90"'s tiles
IMPL = "pallas:sm90"  # the implementation whose tiles these are, as a table's config names it
MAX_CANDIDATES = 5  # tile pairs timed per layer shape (beside one cuBLAS variant): each is a compile of the layer


@dataclasses.dataclass(frozen=True)
class LayerTiles:
    """The tiles of a DoRA / LoRA layer's two sm90 GEMMs: the forward's (tokens, in) x (in, out) and dx's
    (tokens, out) x (out, in)."""

    forward: _sm90.TileConfig
    dx: _sm90.TileConfig

    def to_json(self) -> dict:
        """The tiles as a table's config holds them."""
        return {"impl": IMPL, "forward": dataclasses.asdict(self.forward), "dx": dataclasses.asdict(self.dx)}

    @classmethod
    def from_json(cls, data) -> LayerTiles:
        """The tiles a table's config holds; ValueError (or TypeError) where it holds no such thing."""
        if not isinstance(data, dict) or set(data) != {"impl", "forward", "dx"} or data["impl"] != IMPL:
            raise ValueError(f"expected {{'impl': {IMPL!r}, 'forward': tile, 'dx': tile}}, got {data!r}")
        return cls(_sm90.TileConfig(**data["forward"]), _sm90.TileConfig(**data["dx"]))


def layer_key(tokens: int, fin: int, fout: int, rank: int, dtype, kind: str = "dense") -> str:
    """The shape key of a layer of `tokens` tokens, fin -> fout at the padded rank `rank`, x of `dtype`, a `kind`
    weight: "16384x2048x512 r16 bfloat16 dense" (tokens x in x out, as `fp8.gemm.gemm_key` names M x K x N)."""
    return f"{tokens}x{fin}x{fout} r{rank} {jnp.dtype(dtype).name} {kind}"


def parse_layer_key(key: str) -> tuple[int, int, int, int, jnp.dtype, str]:
    """(tokens, fin, fout, rank, dtype, kind) of a `layer_key`."""
    dims, rank, dtype, kind = key.split(" ")
    tokens, fin, fout = (int(d) for d in dims.split("x"))
    return tokens, fin, fout, int(rank.removeprefix("r")), jnp.dtype(dtype), kind


def rule_tiles(tokens: int, fin: int, fout: int, rank: int) -> LayerTiles:
    """The tiles without a tuned entry: `config_for` each GEMM (large unless it leaves SMs idle)."""
    return LayerTiles(config_for(tokens, fout, fin, rank), config_for(tokens, fin, fout, rank))


def tiles_refuse(tiles: LayerTiles, tokens: int, fin: int, fout: int, rank: int, dtype) -> str | None:
    """Why the kernel would refuse `tiles` for this layer (a shape not of whole tiles, shared memory short), or
    None."""
    itemsize = jnp.dtype(dtype).itemsize
    for what, config in (("forward", tiles.forward), ("dx", tiles.dx)):
        sizes = (config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps, config.epi_tile,
                 config.grid_tile_width)
        if not all(isinstance(v, int) and v > 0 for v in sizes) or config.wg_split not in ("m", "n") \
                or config.tile_m % 64 or config.tile_n % 64 or config.tile_k % 64:
            return f"{what}: tile sizes must be positive multiples of 64 (wgmma, the 128-byte swizzle), got {config}"
    for what, config, (m, n, k) in (("forward", tiles.forward, (tokens, fout, fin)),
                                    ("dx", tiles.dx, (tokens, fin, fout))):
        if config.schedule != "cooperative" or config.cluster not in (None, "m", "n"):
            return f"{what}: the low-rank step runs the cooperative schedule, got {config}"
        if not supported(m, n, k, dtype, config):
            return f"{what}: ({m}, {k}) x ({k}, {n}) is not of whole tiles {config.cluster_tile + (config.tile_k,)}"
        if _smem(config, rank, itemsize) > _sm90.SMEM_LIMIT:
            return f"{what}: {config} needs more than {_sm90.SMEM_LIMIT} bytes of shared memory at rank {rank}"
    return None


def candidate_tiles(tokens: int, fin: int, fout: int, rank: int, dtype) -> dict[str, LayerTiles]:
    """The tiles worth timing for this layer, by name: the rule's ("sm90") first, then each of a few CTA shapes for
    both GEMMs, its ring fitted beside the rank's low-rank slices (`fit_lowrank`): the table's large and small
    tiles and the large tile split along M (256 x 128). (A 64 x 256 tile and a 2-CTA cluster, which the kernel
    accepts, are not offered: neither has been checked against the reference on a GPU in this kernel.) Those the
    kernel refuses at this shape are left out, each pair of tiles is named once, and at most `MAX_CANDIDATES` are
    kept."""
    large, small = tiles()
    itemsize = jnp.dtype(dtype).itemsize
    bases = {"sm90_large": large, "sm90_small": small,
             "sm90_256x128": _sm90.TileConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_split="m")}
    pairs = {"sm90": rule_tiles(tokens, fin, fout, rank)}
    pairs.update({name: LayerTiles(fit_lowrank(base, rank, itemsize), fit_lowrank(base, rank, itemsize))
                  for name, base in bases.items()})
    found: dict[str, LayerTiles] = {}
    for name, pair in pairs.items():
        if pair not in found.values() and tiles_refuse(pair, tokens, fin, fout, rank, dtype) is None:
            found[name] = pair
    return dict(list(found.items())[:MAX_CANDIDATES])


def tuned_tiles(tokens: int, fin: int, fout: int, rank: int, dtype) -> LayerTiles | None:
    """The tiles of the tuned entry at this layer's shape (`_tuning.choice`, looked up while the layer is traced,
    so that `pallas_fused.tune` records it) where it chose "sm90"; None where there is none or it chose another
    variant. An entry of "sm90" the kernel would refuse here is ignored with a warning."""
    key = layer_key(tokens, fin, fout, rank, dtype)
    entry = _tuning.choice(LAYER_OP, key)
    if entry is None or entry["config"].get("impl") not in (IMPL, None):
        return None
    try:
        found = LayerTiles.from_json(entry["config"])
        why = tiles_refuse(found, tokens, fin, fout, rank, dtype)
    except (TypeError, ValueError) as err:
        why = str(err)
    if why is None:
        return found
    warnings.warn(f"pallas_fused: the tuned DoRA tiles at {key!r} ignored: {why}", RuntimeWarning, stacklevel=1)
    return None


def layer_tiles(tokens: int, fin: int, fout: int, rank: int, dtype) -> LayerTiles:
    """The tiles a layer runs: `tuned_tiles`, else `rule_tiles`."""
    return tuned_tiles(tokens, fin, fout, rank, dtype) or rule_tiles(tokens, fin, fout, rank)


def supported(m: int, n: int, k: int, dtype, config: _sm90.TileConfig | None = None, rank: int = 0) -> bool:
    config = config or config_for(m, n, k, rank)
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and _sm90.supported(m, n, k, config)


def layer_refuses(tokens: int, fin: int, fout: int, dtype, rank: int) -> str | None:
    """Why a DoRA / LoRA layer's two GEMMs cannot run here, or None: the forward's (tokens, fin) x (fin, fout) and
    dx's (tokens, fout) x (fout, fin), at the padded rank `rank`, each a 16-bit GEMM of whole tiles."""
    if supported(tokens, fout, fin, dtype, rank=rank) and supported(tokens, fin, fout, dtype, rank=rank):
        return None
    config = config_for(tokens, fout, fin, rank)
    return (f"needs a 16-bit x and token / feature counts that are multiples of the tile {config.cluster_tile} x "
            f"{config.tile_k} both ways (here {tokens} tokens, {fin} -> {fout}, {jnp.dtype(dtype).name})")


def _scaled(acc, vecs, dim: int):
    """acc times vecs[0] plus vecs[1] (if given), both along `dim` of the tile (1: per column, 0: per row)."""
    acc = acc * lax.broadcast_in_dim(vecs[0], acc.shape, [dim])
    if len(vecs) > 1:
        acc = acc + lax.broadcast_in_dim(vecs[1], acc.shape, [dim])
    return acc


def _scale_bias(acc, rows, cols):
    return _scaled(acc, cols, 1)


def _row_scale_bias(acc, rows, cols):  # QDoRA's transposed GEMMs: the output features are the rows
    return _scaled(acc, rows, 0)


def _bias(acc, rows, cols):
    del rows
    return acc + lax.broadcast_in_dim(cols[0], acc.shape, [1]) if cols else acc


@functools.partial(jax.jit, static_argnames=("b_layout", "config", "interpret"))
def scaled_matmul(x, w, g=None, bias=None, *, lowrank=None, b_layout: str = "kn",
                  config: _sm90.TileConfig | None = None, interpret: bool = False):
    """(x @ w + la @ lb) * g[None, :] + bias[None, :] in x's dtype (fp32 accumulation, one rounding); x (M, K), w
    (K, N) ("kn") or (N, K) ("nk"), lowrank = (la (M, R), lb (R, N) or (N, R)) or None, R a multiple of 16; g and
    bias optional. config=None: `config_for` the shape and rank."""
    m, k = x.shape
    n = w.shape[1] if b_layout == "kn" else w.shape[0]
    rank = 0 if lowrank is None else lowrank[0].shape[1]
    config = config or config_for(m, n, k, rank)
    if x.dtype != w.dtype or not supported(m, n, k, x.dtype, config):
        raise ValueError(f"dora.kernel_sm90.scaled_matmul: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must share "
                         f"a 16-bit dtype and be multiples of the tile {config.cluster_tile + (config.tile_k,)}")
    cols = (() if g is None else (g.astype(jnp.float32),)) + (() if bias is None else (bias,))
    return _sm90.matmul(x, w, b_layout=b_layout, col_vecs=cols, epilogue=_bias if g is None else _scale_bias,
                        out_dtype=x.dtype, config=config, name="pallas_fused_dora_gemm_sm90", lowrank=lowrank,
                        interpret=interpret)


# QDoRA: the Int8Kernel's codes are the GEMM's a operand, each K step's int8 tile converted to x's dtype in
# registers and fed to wgmma from there (its A operand may live in registers; B may not), so the GEMMs run
# transposed and store their result transposed:
#   forward  y^T  = q^T x^T + (s B / wscale)^T (x A)^T, scaled per row by g wscale  (q^T written by the column norm)
#   backward dx^T = q (dy g wscale)^T + A us^T                                        (q as stored)
# x, dy g wscale and the low-rank factors are the 16-bit operands, all read K-major ("nk") as stored.
# Converting b's int8 tile through a 16-bit shared-memory scratch tile instead (wgmma's B) took 1.53x the bf16 DoRA
# GEMM at 4096 tokens, 4096 -> 4096 r16 on an H200, where the register operand takes 1.07x (q^T given) and 1.20x
# with an XLA transpose of q before it; dx 0.305 against 0.214 ms (benchmarks/results/logs/
# h200_2026-11-26f_qdora_register_a_probe.log). The scratch tile's cost was the round trip through shared memory
# (read 1, write 2 and wgmma-read 2 bytes per weight beside the ring's traffic).
# Tiles, as measured there: 64 x 256 per warpgroup split along M (the int8 operand's rows), 64 of K per step, the
# snake 4 tiles wide. Its low-rank slices take (128 + 256) x R x 2 bytes beside the ring (the 256 columns held once
# for both warpgroups), so 3 stages fit at rank 64: there it ran the GEMM in 0.621 ms at 4096 tokens 4096 -> 11008
# against 0.752 for 128 x 128 split along M with 4 stages, dx 0.583 against 0.698
# (benchmarks/results/logs/h200_2026-11-26g_qdora_register_a_probe.log). 128 x 128 runs from rank 128, where
# 64 x 256 keeps 2 stages. `qdora_config` takes the first of "tiles" whose ring, as deep as shared memory allows
# (`fit_lowrank`), has "min_stages" stages, else the last.
QDORA_HEURISTIC = {"tiles": [dict(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, wg_split="m",
                                  grid_tile_width=4),
                             dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_split="m")],
                   "min_stages": 3}


def qdora_config(m: int, n: int, k: int, rank: int, dtype) -> _sm90.TileConfig:
    """The tile configuration of a QDoRA GEMM: the int8 (m, k) times the 16-bit (n, k), a low-rank term of rank
    `rank` (padded)."""
    table = _backend.tuned("dora_sm90_int8", QDORA_HEURISTIC)
    for tiles in table["tiles"]:
        config = fit_lowrank(_sm90.TileConfig(**tiles), rank, jnp.dtype(dtype).itemsize, int8_a=True)
        if config.max_concurrent_steps >= table["min_stages"]:
            break
    return config


def qdora_supported(m: int, n: int, k: int, rank: int, dtype) -> bool:
    """Whether the QDoRA GEMM runs these shapes (`qdora_config`'s): 16-bit, whole tiles, a padded rank whose slices
    fit SMEM."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or rank % 16:
        return False
    config = qdora_config(m, n, k, rank, dtype)
    return (_sm90.supported(m, n, k, config)
            and _smem(config, rank, jnp.dtype(dtype).itemsize, int8_a=True) <= _sm90.SMEM_LIMIT)


def qdora_layer_refuses(tokens: int, fin: int, fout: int, dtype, rank: int) -> str | None:
    """Why a QDoRA layer's two GEMMs cannot run here, or None: the forward's (fout, fin) codes times the (tokens,
    fin) x and dx's (fin, fout) codes times the (tokens, fout) dy g wscale, at the padded rank `rank`
    (`qdora_supported`)."""
    if qdora_supported(fout, tokens, fin, rank, dtype) and qdora_supported(fin, tokens, fout, rank, dtype):
        return None
    return (f"needs a 16-bit x and token / feature counts that are multiples of its tiles ({QDORA_HEURISTIC}: M the "
            f"features, N the tokens; here {tokens} tokens, {fin} -> {fout}, rank {rank}, {jnp.dtype(dtype).name})")


def _int8_codes(tile):
    # |q| <= 127 is exact in bf16 / fp16, so the kernel converts the int8 codes straight to x's dtype (Mosaic GPU has
    # a two-instruction int8 -> bf16 pair conversion; through float32 it would be two conversions per element).
    return tile


@functools.partial(jax.jit, static_argnames=("interpret",))
def qdora_forward(x, qt, xa, lb, colscale, bias=None, *, interpret: bool = False):
    """y = (x qt^T + xa lb) colscale + bias in x's dtype; x (M, K), qt int8 (N, K): W's codes transposed, as the
    column norm writes them (Mosaic GPU on Hopper loads no 8-bit tile transposed); xa (M, R), lb (R, N) rank-padded
    to a multiple of 16, colscale float32 (N,). QDoRA passes colscale = g wscale and lb = s B / wscale: the int8
    codes are exact in 16 bits, so the dequant is a plain convert and the per-column scale joins g in the
    epilogue."""
    m, k = x.shape
    n = qt.shape[0]
    config = qdora_config(n, m, k, lb.shape[0], x.dtype)
    rows = (colscale.astype(jnp.float32),) + (() if bias is None else (bias,))
    return _sm90.matmul(qt, x, b_layout="nk", row_vecs=rows, a_dequant=_int8_codes, lowrank=(lb.T, xa),
                        epilogue=_row_scale_bias, out_dtype=x.dtype, config=config, transpose_out=True,
                        name="pallas_fused_qdora_gemm_sm90", interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def qdora_dx(dyg, q, us, a, *, interpret: bool = False):
    """dx = dyg q^T + us A^T in dyg's dtype; dyg = dy g wscale (M, N) (the int8 scale is per contraction index
    here, so it goes on dy, which is scaled anyway), q int8 (K, N) as stored, us (M, R), A (K, R) rank-padded to a
    multiple of 16."""
    m, n = dyg.shape
    k = q.shape[0]
    config = qdora_config(k, m, n, a.shape[1], dyg.dtype)
    return _sm90.matmul(q, dyg, b_layout="nk", a_dequant=_int8_codes, lowrank=(a, us), epilogue=_bias,
                        out_dtype=dyg.dtype, config=config, transpose_out=True, name="pallas_fused_qdora_dx_sm90",
                        interpret=interpret)
