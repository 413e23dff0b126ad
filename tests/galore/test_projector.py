"""The randomized projector: captured energy on a gradient-like (decaying-spectrum) matrix, warm start."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.galore import projector, reference


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("qr", ["cholesky", "householder"])
def test_randomized_energy_cold_and_warm(side, qr):
    shape, rank = (160, 224), 16
    g = projector.low_rank_plus_noise(jax.random.key(0), shape, true_rank=32, decay=0.9)
    exact = reference.svd_projector(g, rank, side)
    p = projector.randomized_projector(g, rank, side, jax.random.key(1), qr=qr)
    assert p.shape == exact.shape
    pm = p.T if side == "right" else p
    np.testing.assert_allclose(pm.T @ pm, np.eye(rank), atol=1e-4)  # orthonormal
    assert float(projector.captured_energy(g, p, exact, side)) >= 0.99
    # a drifted gradient, warm-started from the previous projector
    g2 = g + 0.3 * projector.low_rank_plus_noise(jax.random.key(2), shape, true_rank=32, decay=0.9)
    p2 = projector.randomized_projector(g2, rank, side, jax.random.key(3), prev=p, qr=qr)
    assert float(projector.captured_energy(g2, p2, reference.svd_projector(g2, rank, side), side)) >= 0.99


def test_no_power_iteration_is_worse_and_flat_spectrum_is_hard():
    """The metric is meaningful: a plain sketch captures less than with power iterations."""
    g = projector.low_rank_plus_noise(jax.random.key(0), (160, 224), true_rank=64, decay=0.97)
    exact = reference.svd_projector(g, 16, "left")
    e0 = float(projector.captured_energy(g, projector.randomized_projector(g, 16, "left", jax.random.key(1),
                                                                            power_iters=0), exact, "left"))
    e2 = float(projector.captured_energy(g, projector.randomized_projector(g, 16, "left", jax.random.key(1)),
                                         exact, "left"))
    assert e0 < e2 and e2 >= 0.99


def test_degenerate_gradients_stay_finite():
    for g in [jnp.zeros((48, 80)), jnp.outer(jnp.arange(48.0), jnp.ones(80))]:  # zero, rank 1 < rank
        p = projector.randomized_projector(g, 8, "right", jax.random.key(0))
        assert np.all(np.isfinite(np.asarray(p)))


@pytest.mark.parametrize("shape,rank,side", [((3, 7), 3, "right"), ((3, 7), 3, "left"), ((7, 3), 3, "right"),
                                             ((48, 80), 45, "right"), ((1, 6), 1, "left")])
def test_rank_near_min_dim(shape, rank, side):
    # rank + oversample beyond min(M, N) (GaLore clamps the rank to min(M, N)): the sketch is narrowed to min(M, N)
    # columns, cold and warm, and spans the exact subspace
    g = jax.random.normal(jax.random.key(0), shape)
    exact = reference.svd_projector(g, rank, side)
    span = lambda q: np.asarray(q.T @ q if side == "right" else q @ q.T)  # noqa: E731
    p = projector.randomized_projector(g, rank, side, jax.random.key(1))
    p2 = projector.randomized_projector(g, rank, side, jax.random.key(2), prev=p)
    for q in (p, p2):
        assert q.shape == exact.shape
        np.testing.assert_allclose(span(q), span(exact), atol=1e-5)
