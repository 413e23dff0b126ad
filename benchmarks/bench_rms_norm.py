"""RMSNorm at the example's shape (16 x 1024 tokens, d_model 2048): forward and forward+backward, ours against
the XLA reference (nn.RMSNorm's arithmetic, fused by XLA as it likes).

impls: "user:rms_norm" (the public `rms_norm` under jit, default implementation), "xla" (the reference),
"pallas" (the fused kernels, forced).

Bytes: the fewest the op moves: forward reads x and writes y; the backward reads x and dy and writes dx (the
per-row rstd, the scale and the dscale partials are < 0.1% of it and not counted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.common import Recorder, rnd
from pallas_fused.norm import rms_norm

OP = "rms_norm"
CASES = [((16384, 2048), jnp.bfloat16), ((16384, 2048), jnp.float32), ((16384, 5504), jnp.bfloat16)]
QUICK_CASES = CASES[:1]


def _fns(impl):
    def fwd(x, scale):
        return rms_norm(x, scale, dtype=x.dtype, implementation=None if impl == "user" else impl)

    def fwdbwd(x, scale, dy):
        out, vjp = jax.vjp(fwd, x, scale)  # the output is returned: in training it feeds the next GEMM
        return out, vjp(dy)

    return jax.jit(fwd), jax.jit(fwdbwd)


def run(rec: Recorder, quick: bool) -> None:
    for shape, dtype in (QUICK_CASES if quick else CASES):
        x, dy = rnd(1, shape, dtype), rnd(2, shape, dtype)
        scale = rnd(3, shape[-1:], jnp.float32, scale=0.1) + 1.0
        size = x.size * jnp.dtype(dtype).itemsize
        case = f"{shape[0]}x{shape[1]} {jnp.dtype(dtype).name}"
        for name, impl in (("user:rms_norm", "user"), ("xla", "xla"), ("pallas", "pallas")):
            fwd, fwdbwd = _fns(impl)
            rec.time(OP, f"{case} fwd", name, fwd, x, scale, n=20 if quick else 50, nbytes=2 * size)
            rec.time(OP, f"{case} fwd+bwd", name, fwdbwd, x, scale, dy, n=20 if quick else 50, nbytes=5 * size)
