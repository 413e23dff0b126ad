"""Plain-jnp GaLore Adam: the ground truth for the kernels, and the "xla" implementation.

Notation for one projected (M, N) weight W with gradient G and rank r. The projector has one of two
*sides*, chosen by `proj_type` (as in galore-torch's GaLoreProjector):

    side "right": P is (r, N) (top-r right singular vectors, Vh[:r]); R = G P^T is (M, r); back: R_n P
    side "left":  P is (M, r) (top-r left singular vectors, U[:, :r]); R = P^T G is (r, N); back: P R_n

    proj_type "std":          right if M >= N else left   (keeps the larger dimension; galore-torch default)
    proj_type "reverse_std":  left if M >= N else right   (keeps the smaller one; optax.contrib.galore's choice)
    proj_type "right"/"left": always that side

The low-rank Adam step and the full-rank update take a handful of runtime scalars (`Scalars`), so one
kernel serves both conventions:

    m' = b1 m + (1 - b1) R            v' = b2 v + (1 - b2) R^2
    N  = alpha m' / (beta sqrt(v') + eps)
    out = a * W + c * backproject(N)          (an update, or added to W in place)

reference GaLore ("galore"):  alpha = beta = 1, c = -lr * scale * sqrt(1 - b2^t) / (1 - b1^t), a = -lr * wd
optax.contrib.galore ("optax"): alpha = 1 / (1 - b1^t), beta = 1 / sqrt(1 - b2^t), c = -lr * scale, a = -lr * wd

`ok` (0 or 1) masks a step whose gradient was non-finite: moments are kept and the update is zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PROJ_TYPES = ("std", "reverse_std", "right", "left")


class Scalars(NamedTuple):
    """Runtime scalars of one GaLore Adam step (all fp32 scalars; traced values are fine)."""

    b1: jax.Array
    b2: jax.Array
    eps: jax.Array
    alpha: jax.Array
    beta: jax.Array
    a: jax.Array  # coefficient of W in the output (-lr * wd, or 0)
    c: jax.Array  # coefficient of the back-projected normalized update
    ok: jax.Array  # 1.0: a normal step; 0.0: skip (a non-finite low-rank step: moments kept, update zero)

    def pack(self) -> jax.Array:
        """The (8,) fp32 operand the kernels read."""
        return jnp.stack([jnp.asarray(x, jnp.float32) for x in self])


def projector_side(shape: tuple[int, int], proj_type: str) -> str:
    """"left" or "right" for a (M, N) weight under `proj_type` (see the module docstring)."""
    if proj_type not in PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def projector_shape(shape: tuple[int, int], rank: int, side: str) -> tuple[int, int]:
    m, n = shape
    return (rank, n) if side == "right" else (m, rank)


def projector_rank(p_shape: tuple[int, int], side: str) -> int:
    """The rank of a projector of shape `p_shape` on `side`."""
    return p_shape[0] if side == "right" else p_shape[1]


def lowrank_shape(shape: tuple[int, int], rank: int, side: str) -> tuple[int, int]:
    m, n = shape
    return (m, rank) if side == "right" else (rank, n)


def svd_projector(g: jax.Array, rank: int, side: str, dtype=None) -> jax.Array:
    """The exact projector from a float32 SVD of the gradient (what galore-torch and optax compute)."""
    u, _, vh = jnp.linalg.svd(g.astype(jnp.float32), full_matrices=False)
    p = vh[:rank] if side == "right" else u[:, :rank]
    return p.astype(dtype or g.dtype)


def project(g: jax.Array, p: jax.Array, side: str, precision=None) -> jax.Array:
    """Down-projection R (fp32): G P^T (right) or P^T G (left).

    One dot_general contracting the dimension G and P share, in the layouts they are stored in: no transpose of P
    is written (nor one of G, which XLA would copy), so the GEMM library reads both operands as they lie. Side right
    contracts G's minor (contiguous) dimension with P's; side left contracts G's major dimension with P's, which no
    order of the operands changes (G is stored (M, N))."""
    dtype = jnp.result_type(g, p)
    g, p = g.astype(dtype), p.astype(dtype)
    if side == "right":  # (M, N) x (r, N) -> (M, r)
        return lax.dot_general(g, p, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
    # (M, r) x (M, N) -> (r, N)
    return lax.dot_general(p, g, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def back_project(n: jax.Array, p: jax.Array, side: str, precision=None, dtype=jnp.float32) -> jax.Array:
    """Up-projection: N P (right) or P N (left), both operands (and so the product) in `dtype`."""
    n, p = n.astype(dtype), p.astype(dtype)
    return jnp.matmul(n, p, precision=precision) if side == "right" else jnp.matmul(p, n, precision=precision)


def lowrank_finite(r: jax.Array, m: jax.Array, v: jax.Array, s: Scalars) -> jax.Array:
    """Whether the low-rank step from R is finite (a bool scalar): the moments `lowrank_adam` would store, m' =
    b1 m + (1-b1) R and v' = b2 v + (1-b2) R^2 in m's / v's dtype, hold no NaN or inf. One reduction over R, m and v
    that writes nothing of their size: the step then computes its moments once, with this flag as its `ok` (kept
    moments and a zero update when it is False), so no copy of the old moments is ever needed."""
    f32 = jnp.float32
    r = r.astype(f32)
    m_new = (s.b1 * m.astype(f32) + (1 - s.b1) * r).astype(m.dtype)
    v_new = (s.b2 * v.astype(f32) + (1 - s.b2) * r * r).astype(v.dtype)
    return jnp.all(jnp.isfinite(m_new) & jnp.isfinite(v_new))


def lowrank_adam(r: jax.Array, m: jax.Array, v: jax.Array, s: Scalars):
    """The low-rank Adam moments and normalized update: returns (m', v', N) with m', v' in m's/v's dtype. With s.ok
    = 0 the moments are m and v themselves (bit for bit) and N is finite (from them)."""
    f32 = jnp.float32
    ok = jnp.asarray(s.ok, f32) > 0
    r = r.astype(f32)
    m32, v32 = m.astype(f32), v.astype(f32)
    m_new = jnp.where(ok, s.b1 * m32 + (1 - s.b1) * r, m32)
    v_new = jnp.where(ok, s.b2 * v32 + (1 - s.b2) * r * r, v32)
    n = (s.alpha * m_new) / (s.beta * jnp.sqrt(v_new) + s.eps)
    return m_new.astype(m.dtype), v_new.astype(v.dtype), n


def full_update(w: jax.Array, n: jax.Array, p: jax.Array, side: str, s: Scalars, precision=None) -> jax.Array:
    """out = a * W + c * backproject(N), fp32 (zero when the step is skipped)."""
    ok = jnp.asarray(s.ok, jnp.float32) > 0
    out = s.a * w.astype(jnp.float32) + s.c * back_project(n, p, side, precision)
    return jnp.where(ok, out, 0.0)


def finish_step(w, n: jax.Array, p: jax.Array, side: str, s: Scalars, *, inplace: bool = False, dtype=None,
                precision=None) -> jax.Array:
    """A step's full-rank output from the normalized low-rank update N: the update (in W's dtype) or, with
    `inplace`, the new W. w=None (no weight decay, not in place): c * backproject(N) in `dtype`."""
    if w is None and inplace:
        raise ValueError("finish_step: inplace=True needs w (the weight to update)")
    if w is None:
        # The update is c * backproject(N) alone: scale the small N rather than the product, so that the update
        # is the GEMM's own output and `optax.apply_updates` (p + update) can fold into that GEMM as its addend.
        ok = jnp.asarray(s.ok, jnp.float32) > 0
        # A 16-bit projector and update: the GEMM in P's dtype (fp32 accumulation) reads half the bytes at twice
        # TF32's rate, and the update is rounded to 16 bits anyway (optax.contrib.galore's GEMM here).
        low = jnp.dtype(p.dtype).itemsize < 4 and jnp.dtype(dtype or p.dtype).itemsize < 4
        op = p.dtype if low else jnp.float32
        # The select after the cast: the GEMM's operand is then a select, not a convert, which XLA:GPU would fuse
        # into a Triton GEMM of its own (with the caller's add as its epilogue) instead of the cuBLAS GEMM whose
        # beta = 1 takes the add, as optax.contrib.galore's 16-bit GEMM gets.
        n = jnp.where(ok, (n.astype(jnp.float32) * s.c).astype(op), jnp.zeros((), op))
        return back_project(n, p, side, precision, op).astype(dtype)
    w32 = w.astype(jnp.float32)
    out = full_update(w32, n, p, side, s, precision)
    if inplace:  # a skipped step writes W back as it was (bit for bit: W + 0 would turn -0.0 into 0.0)
        out = jnp.where(jnp.asarray(s.ok, jnp.float32) > 0, w32 + out, w32)
    return out.astype(w.dtype)


def galore_adam_step(w, g, m, v, p, side: str, s: Scalars, *, inplace: bool = False, precision=None):
    """One projected-leaf step with a given projector: returns (out, m', v') where out is the update
    (in W's dtype, or G's when w is None: no weight decay) or, with `inplace`, the new W."""
    r = project(g, p, side, precision)
    m, v, n = lowrank_adam(r, m, v, s)
    return finish_step(w, n, p, side, s, inplace=inplace, dtype=g.dtype, precision=precision), m, v
