"""Backs the skip check's fusions in docs/performance.md (2026-11-26d_h200_galore_host_refresh_hlo_*.txt).

Development probe: the optimized HLO of GaLore's optax step on the host's refresh schedule (refresh=False, bf16
and fp32 4096x4096 r128), written to OUT_DIR, with its reduce fusions printed.

    python benchmarks/probes/galore_hlo_dump.py OUT_DIR
"""

import re
import sys

import jax.numpy as jnp

from benchmarks.bench_galore import _user_path_txs, user_path_step

txs = dict(_user_path_txs(128))
for shape, dtype in [((4096, 4096), jnp.bfloat16), ((4096, 4096), jnp.float32)]:
    step, carry = user_path_step("pallas:tx_host_refresh", txs["pallas:tx_host_refresh"], {"w": shape}, dtype)
    text = step.lower(*carry).compile().as_text()
    with open(f"{sys.argv[1]}/hlo_{shape[0]}x{shape[1]}_{jnp.dtype(dtype).name}.txt", "w") as f:
        f.write(text)
    for m in re.finditer(r"^(%?\S*input_reduce_fusion\S*) = .*$", text, re.M):
        print(m.group(0)[:600])
