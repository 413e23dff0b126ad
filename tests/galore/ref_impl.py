"""An independent plain-jnp GaLore AdamW written from galore-torch's GaLoreAdamW loop (per-parameter
state dicts, Python step counter), used as the ground truth for the optax transforms.

Differences from galore-torch, all documented in pallas_fused.galore.api: weight decay uses the
pre-step W (-lr * wd * W, as optax's AdamW); leaves that are not projected follow optax.scale_by_adam
(m_hat / (sqrt(v_hat) + eps))."""

import jax.numpy as jnp


def _side(shape, proj_type):
    m, n = shape
    return {"std": "right" if m >= n else "left", "reverse_std": "left" if m >= n else "right",
            "right": "right", "left": "left"}[proj_type]


class RefGaLoreAdamW:
    def __init__(self, lr, rank, gap, scale, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, proj_type="std", projected=None):
        self.lr, self.rank, self.gap, self.scale = lr, rank, gap, scale
        self.b1, self.b2, self.eps, self.wd, self.proj_type = b1, b2, eps, wd, proj_type
        # every 2-D leaf; P = U[:, :rank] / Vh[:rank] clamps the rank to min(M, N), as galore-torch's slicing does
        self.projected = projected or (lambda p: p.ndim == 2)
        self.state = {}

    def step(self, params: dict, grads: dict) -> dict:
        out = {}
        for k, p in params.items():
            g = grads[k].astype(jnp.float32)
            st = self.state.setdefault(k, {"step": 0})
            proj = self.projected(p)
            if proj:
                side = _side(p.shape, self.proj_type)
                if st["step"] % self.gap == 0:
                    u, _, vh = jnp.linalg.svd(g, full_matrices=False)
                    st["P"] = vh[: self.rank] if side == "right" else u[:, : self.rank]
                g = g @ st["P"].T if side == "right" else st["P"].T @ g
            if "m" not in st:
                st["m"], st["v"] = jnp.zeros_like(g), jnp.zeros_like(g)
            st["m"] = self.b1 * st["m"] + (1 - self.b1) * g
            st["v"] = self.b2 * st["v"] + (1 - self.b2) * g * g
            st["step"] += 1
            t = st["step"]
            bc1, bc2 = 1 - self.b1**t, 1 - self.b2**t
            if proj:
                n = st["m"] / (jnp.sqrt(st["v"]) + self.eps)
                n = n @ st["P"] if side == "right" else st["P"] @ n
                upd = self.lr * (bc2**0.5) / bc1 * self.scale * n
            else:
                upd = self.lr * (st["m"] / bc1) / (jnp.sqrt(st["v"] / bc2) + self.eps)
            out[k] = (p.astype(jnp.float32) - upd - self.lr * self.wd * p.astype(jnp.float32)).astype(p.dtype)
        return out
