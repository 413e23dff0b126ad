"""Projector refresh: the exact SVD and a randomized range finder (Halko, Martinsson & Tropp 2011).

`jnp.linalg.svd` of a 4096x4096 fp32 gradient takes ~1.2 s on an H200; GaLore needs only the top-r
singular subspace, which a randomized range finder gets from a few tall-skinny GEMMs:

    Q  = orth(A Omega)                        Omega: (n, r + oversample) Gaussian      (cold start)
    Q  = orth([P_prev, A Omega_p])            the previous projector + `oversample` fresh columns (warm)
    repeat power_iters:  Z = orth(A^T Q);  Q = orth(A Z)          (subspace iteration)
    B  = A^T Q;  eigh(B^T B) = V diag(s^2) V^T;   P = Q V[:, top r]

where A = G for side "left" (P spans the column space) and A = G^T for side "right". Orthonormalisation
is CholeskyQR2 by default (two rounds of Y R^-1 with R = chol(Y^T Y + shift): two small GEMMs and an
(l x l) Cholesky instead of a Householder QR of a tall matrix, which is slow on GPUs; Householder is the
fallback when Y is numerically rank-deficient), or `qr="householder"` (jnp.linalg.qr) throughout.
All in fp32 with HIGHEST matmul precision so the basis stays orthonormal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fused.galore import reference

HI = lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HI)


def _chol_qr(y: jax.Array) -> jax.Array:
    """One round of shifted CholeskyQR: y R^-1 with R^T R = y^T y + shift (shift keeps rank-deficient y finite)."""
    gram = _mm(y.T, y)
    l = gram.shape[0]
    shift = 1e-6 * jnp.trace(gram) / l + jnp.finfo(jnp.float32).tiny
    chol = jnp.linalg.cholesky(gram + shift * jnp.eye(l, dtype=gram.dtype))  # lower L, gram = L L^T
    # Q = y L^-T  <=>  Q^T = L^-1 y^T
    return jax.scipy.linalg.solve_triangular(chol, y.T, lower=True).T


def orthonormalize(y: jax.Array, qr: str = "cholesky") -> jax.Array:
    """An orthonormal basis of y's columns. CholeskyQR2, falling back to Householder QR (under lax.cond, so
    only paid then) when y is numerically rank-deficient: the Cholesky then fails (NaN) or leaves columns
    far from unit norm."""
    if qr == "householder":
        return jnp.linalg.qr(y)[0]
    q = _chol_qr(_chol_qr(y))
    norms = jnp.sum(q * q, axis=0)
    good = jnp.all(jnp.abs(norms - 1.0) < 1e-2)  # NaN compares False
    return lax.cond(good, lambda: q, lambda: jnp.linalg.qr(y)[0])


@functools.partial(jax.jit, static_argnames=("rank", "side", "oversample", "power_iters", "qr", "dtype"))
def randomized_projector(g: jax.Array, rank: int, side: str, key: jax.Array, prev: jax.Array | None = None, *,
                         oversample: int = 8, power_iters: int = 2, qr: str = "cholesky", dtype=None) -> jax.Array:
    """A rank-`rank` projector (same shape/side as `reference.svd_projector`) from a randomized range finder.

    `prev`: the previous projector of this leaf (warm start), or None for a cold start; a `prev` of zeros (a projector
    never computed, as GaLore's state starts) also starts cold, decided on the device by a lax.cond around the first
    sketch alone, so one copy of the iterations serves both starts. Returns `dtype` (default g.dtype)."""
    g32 = g.astype(jnp.float32)
    if side == "right":  # A = G^T (n x m): its column space is G's row space
        a_mul = lambda x: _mm(g32.T, x)
        at_mul = lambda x: _mm(g32, x)
        n_other = g.shape[0]
    else:
        a_mul = lambda x: _mm(g32, x)
        at_mul = lambda x: _mm(g32.T, x)
        n_other = g.shape[1]
    # at most min(M, N) columns, so that the (M or N, l) bases of both subspace steps have full column rank (a rank
    # near min(M, N) leaves less room for oversampling)
    l = min(rank + oversample, *g.shape)
    cold = lambda: a_mul(jax.random.normal(key, (n_other, l), jnp.float32))
    if prev is None:
        y = cold()
    else:
        def warm():
            p_prev = (prev.T if side == "right" else prev).astype(jnp.float32)
            return jnp.concatenate([p_prev, a_mul(jax.random.normal(key, (n_other, l - rank), jnp.float32))], axis=1)

        y = lax.cond(jnp.all(prev == 0), cold, warm)
    q = orthonormalize(y, qr)
    for _ in range(power_iters):
        q = orthonormalize(a_mul(orthonormalize(at_mul(q), qr)), qr)
    b = at_mul(q)  # (other, l) = A^T Q
    _, vecs = jnp.linalg.eigh(_mm(b.T, b))  # ascending eigenvalues
    p = _mm(q, vecs[:, ::-1][:, :rank])
    p = p.T if side == "right" else p
    return p.astype(dtype or g.dtype)


@functools.partial(jax.jit, static_argnames=("side",))
def captured_energy(g: jax.Array, p: jax.Array, p_exact: jax.Array, side: str) -> jax.Array:
    """||P G||^2 / ||P_exact G||^2: the fraction of the best rank-r energy a projector keeps."""
    e = lambda q: jnp.sum(jnp.square(reference.project(g.astype(jnp.float32), q.astype(jnp.float32), side, HI)))
    return e(p) / e(p_exact)


@functools.partial(jax.jit, static_argnames=("shape", "true_rank", "decay", "noise"))
def low_rank_plus_noise(key: jax.Array, shape: tuple[int, int], true_rank: int = 64, decay: float = 0.95,
                        noise: float = 0.05) -> jax.Array:
    """A gradient-like test matrix with a decaying spectrum (a Gaussian matrix has a flat one, on which no
    rank-r projector captures much more than r/min(m, n) of the energy): sum_k decay^k u_k v_k^T + noise."""
    k1, k2, k3 = jax.random.split(key, 3)
    m, n = shape
    u = jnp.linalg.qr(jax.random.normal(k1, (m, true_rank)))[0]
    v = jnp.linalg.qr(jax.random.normal(k2, (n, true_rank)))[0]
    s = decay ** jnp.arange(true_rank, dtype=jnp.float32)
    return _mm(u * s, v.T) + noise * jax.random.normal(k3, shape) / jnp.sqrt(float(max(m, n)))
