import jax, jax.numpy as jnp, optax, re
from pallas_fused.optim import galore_adamw
for kernel in ("auto", "hybrid"):
    tx = galore_adamw(1e-3, rank=128, update_proj_gap=10**9, kernel=kernel)
    p = {"w": jax.random.normal(jax.random.key(0), (4096, 4096))}
    s = tx.init(p)
    def step(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    txt = jax.jit(step, donate_argnums=(0, 2)).lower(p, p, s).compile().as_text()
    gemms = [l.strip()[:400] for l in txt.splitlines() if "__cublas" in l and "custom-call(" in l]
    print(f"== kernel={kernel}: {len(gemms)} cublas gemms")
    for l in gemms:
        beta = re.search(r'"beta":"?([0-9.e-]+)', l)
        print("  ", l[:160], "| beta", beta.group(1) if beta else "?")
