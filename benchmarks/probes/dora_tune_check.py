"""Checks the DoRA tuner's candidates on a GPU: each one's forward and backward against the XLA reference, then tunes.

    timeout 290 python3 -m benchmarks.probes.dora_tune_check --budget 120

For each DoRA layer shape of examples/train_llama.py's GPU preset (rank 16, bf16) that plain "pallas" looks up on
this GPU, every candidate of `dora.impls.layer_candidates` runs once (the tuner's own call, `layer_build`) and its
gradients (dx, dA, dB, dm) are compared with XLA's float32 reference on the same operands: a tile that runs but
computes wrongly must never be chosen. Then `pallas_fused.tune` tunes those layers (`--budget` seconds) into a cache
under $OUT. Writes $OUT/dora_tune_check.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def main(argv=None) -> int:
    from pallas_fused import _tuning, dora
    from pallas_fused.dora import impls
    from pallas_fused.tune import tune
    from pallas_fused.tune.__main__ import dora_layers

    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=120.0)
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args(argv)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    spec, dt = jax.ShapeDtypeStruct, jnp.bfloat16
    layers = [(spec((args.tokens, fin), dt), spec((fin, fout), dt), spec((fin, 16), dt), spec((16, fout), dt),
               spec((fout,), jnp.float32)) for fin, fout in dora_layers(2048, 512, 5504)]

    def model(layers):
        def loss(x, w, a, b, m):
            return dora.dora_dense(x, w, a, b, m, scale=2.0).astype(jnp.float32).sum()
        return [jax.grad(loss, argnums=(0, 2, 3, 4))(*layer) for layer in layers]

    with _tuning.recording() as seen:
        jax.eval_shape(model, layers)
    rows = []
    for _, key in seen:
        sets = impls.layer_operands(key)
        x, w, a, b, m, dy = sets[0]
        f32 = [v.astype(jnp.float32) for v in (x, a, b, m)]
        w32 = w.astype(jnp.float32)
        with jax.default_matmul_precision("highest"):
            _, vjp = jax.vjp(lambda x, a, b, m, w32=w32: impls.XLA(impls.DoraArgs(x, w32, a, b, m, scale=2.0)),
                             *f32)
            expect = vjp(dy.astype(jnp.float32))
        for name, config in impls.layer_candidates(key).items():
            start = time.perf_counter()
            try:
                call, _ = impls.layer_build(key, config)
                got = jax.block_until_ready(call())[0]
                err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - e)) / float(jnp.max(jnp.abs(e))))
                          for g, e in zip(got, expect))
                status = "ok" if err < 2e-2 else "WRONG"
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, the tuner skips it too
                err, status = None, f"failed: {type(exc).__name__}: {str(exc)[:100]}"
            rows.append({"key": key, "candidate": name, "max_rel_err": err, "status": status,
                         "s": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
    result = tune(model, layers, budget_s=args.budget, cache_dir=out / "tuning", progress=False)
    (out / "dora_tune_check.json").write_text(json.dumps({"checks": rows, "entries": result.entries}, indent=1))
    print(f"\n{'shape':<36} {'candidate':<16} {'max rel err':>12}  status")
    for r in rows:
        err = f"{r['max_rel_err']:.2e}" if r["max_rel_err"] is not None else "-"
        print(f"{r['key']:<36} {r['candidate']:<16} {err:>12}  {r['status']}")
    print(result.table())
    return 0 if all(r["status"] != "WRONG" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
