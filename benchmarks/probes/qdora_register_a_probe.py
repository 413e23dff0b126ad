"""Backs docs/performance.md: the register-A QDoRA GEMM, 0.621 against 0.752 ms at 4096 -> 11008 r64.

QDoRA's GEMMs with the int8 weight as wgmma's A operand converted in registers (`_sm90.matmul(a_dequant=)`,
result stored transposed) against the int8 weight as B through a 16-bit shared-memory scratch tile
(`_sm90.matmul(dequant=)`, QDoRA's previous GEMM), DoRA's bf16 GEMM and cuBLAS (development probe).

    python -m benchmarks.probes.qdora_register_a_probe OUT_DIR [TOKENSxINxOUT:R ...]

(default: 4096 tokens 4096 -> 4096 r16 and 4096 -> 11008 r64, forward and dx, and 8192 tokens r16 forward; named
cases run both directions)

Per case (tokens, in -> out, rank; bf16) and direction (forward y = (x q + xa lb) colscale + bias, dx = dyg q^T +
us A^T), in turn (common.bench_interleaved) after a check against XLA in fp32: the register-A GEMM at several tile
configurations (the forward with and without its XLA transpose of q), the scratch-tile GEMM at its old
configuration, DoRA's bf16 GEMM (`dora.kernel_sm90.scaled_matmul`) and cuBLAS's x @ W. Rows go to
OUT_DIR/qdora_register_a_probe.json.

Its scratch-tile rows call `_sm90.matmul(dequant=)`, which this comparison retired: it ran on a tree holding both
paths, never committed as such (benchmarks/results/logs/h200_2026-11-26f_qdora_register_a_probe.log); at later
commits those rows fail to build and are recorded as errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench_interleaved, error_text, probe_command_line, rnd
from pallas_fused import _sm90
from pallas_fused.dora import kernel_sm90 as dora_sm90
from pallas_fused.dora import quantize_int8

SCRATCH = dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)  # the scratch-tile GEMM's tiles
REGISTER_A = {
    "64x256x64 m": dict(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, wg_split="m"),
    "64x256x64 m gw4": dict(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, wg_split="m",
                            grid_tile_width=4),
    "64x256x64 m minor-m": dict(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, wg_split="m",
                                grid_minor_dim="m"),
    "128x128x64 n": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_split="n"),
    "128x128x64 m": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_split="m"),
    "64x256x128 m": dict(tile_m=64, tile_n=256, tile_k=128, max_concurrent_steps=2, wg_split="m"),
    "64x256x64 m cluster n": dict(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, wg_split="m",
                                  cluster="n"),
}


def fit(config: dict, rank: int, int8_a: bool) -> _sm90.TileConfig:
    return dora_sm90.fit_lowrank(_sm90.TileConfig(**config), rank, 2, int8_a=int8_a)


def scratch_fit(rank: int) -> _sm90.TileConfig:
    """The scratch-tile GEMM's deepest ring beside its two 16-bit scratch tiles and low-rank slices."""
    config = _sm90.TileConfig(**SCRATCH)
    scratch = 2 * config.tile_k * config.tile_n * 2
    while _sm90.smem_bytes(config, 2, 1, 2, rank, 2) + scratch > _sm90.SMEM_LIMIT:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def case(record, tokens, d_in, d_out, rank, directions):
    bf, f32 = jnp.bfloat16, jnp.float32
    x, w = rnd(1, (tokens, d_in), bf), rnd(2, (d_in, d_out), bf)
    xa, lb = rnd(3, (tokens, rank), bf), rnd(4, (rank, d_out), bf) * 0.1
    g, bias = 1.0 + 0.1 * rnd(5, (d_out,), f32), rnd(6, (d_out,), bf)
    dy, us, a = rnd(7, (tokens, d_out), bf), rnd(8, (tokens, rank), bf), rnd(9, (d_in, rank), bf) * 0.1
    qw = quantize_int8(w)
    q, wscale = qw.q, qw.scale
    lbq = (lb.astype(f32) / wscale).astype(bf)
    colscale = g * wscale
    dyg = (dy.astype(f32) * colscale).astype(bf)
    name = f"{tokens} tok {d_in}->{d_out} r{rank}"
    for direction in directions:
        if direction == "forward":
            want = np.asarray((x.astype(f32) @ q.astype(f32) + xa.astype(f32) @ lbq.astype(f32)) * colscale
                              + bias.astype(f32))
            m, n, k = d_out, tokens, d_in
            cands = {"cublas x@W": (jax.jit(lambda x, w: x @ w), (x, w)),
                     "dora bf16 gemm": (jax.jit(lambda *v: dora_sm90.scaled_matmul(
                         v[0], v[1], v[2], v[3], lowrank=(v[4], v[5]))), (x, w, g, bias, xa, lb))}
            cfg = scratch_fit(rank)
            cands["int8 B via scratch"] = (jax.jit(lambda x, q, xa, lb, cs, bias, cfg=cfg: _sm90.matmul(
                x, q, b_layout="kn", col_vecs=(cs, bias), dequant=dora_sm90._int8_codes, lowrank=(xa, lb),
                epilogue=dora_sm90._scale_bias, out_dtype=bf, config=cfg, name="qdora_scratch")),
                (x, q, xa, lbq, colscale, bias))
            cands["int8 A regs: qdora_forward (q^T by XLA)"] = (jax.jit(
                lambda x, q, *v: dora_sm90.qdora_forward(x, q.T, *v)), (x, q, xa, lbq, colscale, bias))
            for tag, table in REGISTER_A.items():
                cfg = fit(table, rank, True)
                cands[f"int8 A regs {tag} (q^T given)"] = (jax.jit(
                    lambda qt, x, xa, lb, cs, bias, cfg=cfg: _sm90.matmul(
                        qt, x, b_layout="nk", row_vecs=(cs, bias), a_dequant=dora_sm90._int8_codes,
                        lowrank=(lb.T, xa), epilogue=dora_sm90._row_scale_bias, out_dtype=bf, config=cfg,
                        transpose_out=True, name="qdora_register_a")), (q.T, x, xa, lbq, colscale, bias))
        else:
            want = np.asarray(dyg.astype(f32) @ q.astype(f32).T + us.astype(f32) @ a.astype(f32).T)
            m, n, k = d_in, tokens, d_out
            cands = {"cublas dy@W^T": (jax.jit(lambda d, w: d @ w.T), (dy, w)),
                     "dora bf16 dx gemm": (jax.jit(lambda d, w, us, a: dora_sm90.scaled_matmul(
                         d, w, lowrank=(us, a), b_layout="nk")), (dyg, w, us, a))}
            cfg = scratch_fit(rank)
            cands["int8 B via scratch"] = (jax.jit(lambda d, q, us, a, cfg=cfg: _sm90.matmul(
                d, q, b_layout="nk", dequant=dora_sm90._int8_codes, lowrank=(us, a), epilogue=dora_sm90._bias,
                out_dtype=bf, config=cfg, name="qdora_dx_scratch")), (dyg, q, us, a))
            cands["int8 A regs: qdora_dx"] = (dora_sm90.qdora_dx, (dyg, q, us, a))
            for tag, table in REGISTER_A.items():
                cfg = fit(table, rank, True)
                cands[f"int8 A regs {tag}"] = (jax.jit(lambda d, q, us, a, cfg=cfg: _sm90.matmul(
                    q, d, b_layout="nk", a_dequant=dora_sm90._int8_codes, lowrank=(a, us), epilogue=dora_sm90._bias,
                    out_dtype=bf, config=cfg, transpose_out=True, name="qdora_dx_register_a")), (dyg, q, us, a))
        good = {}
        for label, (fn, args) in cands.items():
            try:
                out = np.asarray(fn(*args), np.float32)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result
                record(case=name, direction=direction, impl=label, error=error_text(e))
                continue
            if not label.startswith(("cublas", "dora bf16")):  # these multiply W, not the codes: timed only
                err = float(np.abs(out - want).max() / np.abs(want).max())
                if err > 2e-2:
                    record(case=name, direction=direction, impl=label, rel_err=err, error="MISMATCH")
                    continue
            good[label] = (fn, args)
        times = bench_interleaved(good, n=20, reps=4)
        base = times.get("dora bf16 gemm") or times.get("dora bf16 dx gemm")
        for label, ms in times.items():
            record(case=name, direction=direction, impl=label, ms=round(ms, 5),
                   tflops=round(2 * m * n * k / ms / 1e9, 1), vs_dora_bf16=round(ms / base, 3) if base else None)


def main():
    record, named = probe_command_line("qdora_register_a_probe", [])
    for shape in named:
        case(record, *shape, ("forward", "dx"))
    if not named:
        case(record, 4096, 4096, 4096, 16, ("forward", "dx"))
        case(record, 4096, 4096, 11008, 64, ("forward", "dx"))
        case(record, 8192, 4096, 4096, 16, ("forward",))


if __name__ == "__main__":
    main()
