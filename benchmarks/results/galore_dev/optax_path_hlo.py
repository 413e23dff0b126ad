"""Which cuBLAS GEMMs the compiled optax GaLore step runs (4096x4096 r128 fp32, no refresh, params donated).

    python benchmarks/results/galore_dev/optax_path_hlo.py

With kernel "auto" (no weight decay) the up-projection is XLA's GEMM and W appears as its third operand:
optax.apply_updates' add folded into it. With kernel "hybrid" the up-projection is the Pallas kernel.
"""

import jax
import optax

from pallas_fused.optim import galore_adamw


def main():
    for kernel in ("pallas", "pallas:hybrid"):
        tx = galore_adamw(1e-3, rank=128, update_proj_gap=10**9, implementation=kernel)
        params = {"w": jax.random.normal(jax.random.key(0), (4096, 4096))}
        state = tx.init(params)

        def step(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        text = jax.jit(step, donate_argnums=(0, 2)).lower(params, params, state).compile().as_text()
        gemms = [line.strip() for line in text.splitlines() if "__cublas" in line and "custom-call(" in line]
        print(f"== kernel={kernel}: {len(gemms)} cublas gemms")
        for line in gemms:
            print("  ", line[:160])


if __name__ == "__main__":
    main()
