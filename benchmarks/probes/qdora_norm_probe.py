"""Backs docs/performance.md: the column norm writing q^T takes 30 against 26 + 17 us at 4096 x 4096.

QDoRA's column norm over int8 codes, with and without the transposed codes it writes for the Hopper forward,
against XLA's transpose of the codes alone and bf16 DoRA's norm (development probe).

    python -m benchmarks.probes.qdora_norm_probe OUT_DIR

Per weight (in -> out, rank; bf16 adapters), each candidate amortized over k distinct weights per jit
(common.bench_amortized), all timed in turn (common.bench_interleaved): the "expand" and "direct" kernels at their
defaults, and the "direct" launch writing q^T (`transposed_codes`) at several tiles (NormConfig.codes_t), after a
check of the codes and of n against the plain call. Rows go to OUT_DIR/qdora_norm_probe.json with the bytes each
moves and its % of the HBM ceiling.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Ceilings, amortized, bench_interleaved, error_text, probe_recorder, rnd
from pallas_fused.dora import kernel_norm, quantize_int8
from pallas_fused.dora.kernel_norm import NormConfig, NormTiles

WEIGHTS = [(4096, 4096, 16), (4096, 11008, 64)]
K_SETS = 6  # distinct weights per jit: 6 x 16 MiB of codes pass the 50 MB L2
PLAIN = {"expand default": NormConfig(), "direct default": NormConfig(mode="direct")}
# (bn, bk, rows, warps, stages) of the "direct" launch that also writes q^T (NormConfig.codes_t)
CODES_T = [(128, 32, 512, 4, 2), (64, 64, 512, 4, 2), (128, 64, 512, 4, 2), (128, 64, 1024, 8, 2),
           (64, 128, 1024, 4, 2), (256, 32, 512, 8, 2), (128, 32, 1024, 4, 2), (32, 128, 512, 4, 2),
           (128, 128, 512, 8, 2)]


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "qdora_norm_probe.json"))
    hbm = Ceilings.measure(quick=True).hbm_gbps
    print(jax.devices(), f"HBM ceiling {hbm:.0f} GB/s", flush=True)
    for fin, fout, r in WEIGHTS:
        case = f"{fin}->{fout} r{r}"
        sets = []
        for i in range(K_SETS):
            q = quantize_int8(rnd(10 * i, (fin, fout), scale=0.02))
            a, b = rnd(10 * i + 1, (fin, r), jnp.bfloat16, 0.1), rnd(10 * i + 2, (r, fout), jnp.bfloat16, 0.1)
            m = jnp.abs(rnd(10 * i + 3, (fout,))) + 0.5
            sets.append((q.q, q.scale, a, b, m))
        bf16_sets = [(q.astype(jnp.bfloat16) * s.astype(jnp.bfloat16), a, b, m) for q, s, a, b, m in sets]
        cands, nbytes = {}, {}
        codes = fin * fout + 2 * (fin + fout) * r + 8 * fout
        configs = {f"int8 {name}": (cfg, False) for name, cfg in PLAIN.items()}
        configs.update({"int8 direct bn{} bk{} rows{} w{} s{} + q^T".format(*t): (
            NormConfig(codes_t=NormTiles(*t)), True) for t in CODES_T})
        for label, (cfg, emit) in configs.items():
            def fn(q, s, a, b, m, cfg=cfg, emit=emit):
                return kernel_norm.column_norm_scale((q, s), "int8", a, b, 2.0, m, interpret=False, config=cfg,
                                                     transposed_codes=emit)
            cands[label] = (amortized(fn), (sets,))
            nbytes[label] = codes + (fin * fout if emit else 0)
        cands["xla q.T alone"] = (amortized(lambda q, *_: q.T), (sets,))
        nbytes["xla q.T alone"] = 2 * fin * fout
        cands["bf16 DoRA norm (default)"] = (amortized(lambda w, a, b, m: kernel_norm.column_norm_scale(
            (w,), "dense", a, b, 2.0, m, interpret=False)), (bf16_sets,))
        nbytes["bf16 DoRA norm (default)"] = 2 * fin * fout + 2 * (fin + fout) * r + 8 * fout
        ok = {}
        q, s, a, b, m = sets[0]
        want_t = np.where(np.asarray(s)[None, :] != 0, np.asarray(q), 0).T
        n_ref = kernel_norm.column_norm_scale((q, s), "int8", a, b, 2.0, m, interpret=False)[0]
        for label, (fn, args) in cands.items():
            try:
                out = jax.block_until_ready(fn(*args))[0]
                if label.startswith("int8"):
                    err = float(jnp.max(jnp.abs(out[0] - n_ref) / n_ref))
                    assert err < 1e-5, f"n off by {err}"
                    if label.endswith("q^T"):
                        assert np.array_equal(np.asarray(out[2]), want_t), "q^T wrong"
                ok[label] = (fn, args)
            except Exception as e:  # noqa: BLE001 - a probe records what failed
                record(case=case, impl=label, error=error_text(e))
        times = bench_interleaved(ok, n=20, reps=5)
        for label, ms in times.items():
            per = ms / K_SETS
            record(case=case, impl=label, us=round(per * 1e3, 2),
                   pct_hbm=round(100 * nbytes[label] / (per * 1e-3) / (hbm * 1e9), 1))


if __name__ == "__main__":
    main()
