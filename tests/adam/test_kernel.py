"""The fused Adam kernels against their jnp reference, and the 8-bit codec against brute force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.adam import kernel as K
from pallas_fused.adam import reference as R
from tests.helpers import assert_all_written, rand, rel_err


def _scalars(t=3, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, wd=0.05):
    return K.scalar_operand([-lr, b1, 1 - b1, b2, 1 - b2, eps, eps_root, wd, 1 - b1**t, 1 - b2**t])


def _bnb_dynamic_map(signed):
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), written out."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = np.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2
        data += list(10.0 ** (i - 6) * means)
        if signed:
            data += list(-(10.0 ** (i - 6)) * means)
    data += [0.0, 1.0]
    return np.sort(np.asarray(data))


def test_maps_are_bitsandbytes_dynamic_maps():
    unsigned = np.sort(R.UNSIGNED_MAP.table.astype(np.float64))
    np.testing.assert_allclose(unsigned, _bnb_dynamic_map(False), rtol=1e-6, atol=0)
    # signed: bitsandbytes' values, except its +-5.5e-7 pair is an exact zero and -1.0 is added
    bnb = _bnb_dynamic_map(True)
    bnb = np.sort(np.concatenate([bnb[np.abs(bnb) > 1e-6], [0.0, -1.0]]))
    ours = np.unique(R.SIGNED_MAP.table.astype(np.float64))  # +0 and -0 are one value
    np.testing.assert_allclose(ours, bnb, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dmap", [R.SIGNED_MAP, R.UNSIGNED_MAP], ids=["signed", "unsigned"])
def test_encode_is_nearest_code(dmap):
    mags = dmap.table[:128] if dmap.signed else dmap.table
    rng = np.random.default_rng(0)
    mids = (mags[1:] + mags[:-1]) / 2
    a = np.concatenate([rng.random(20000) ** 8, rng.random(2000), mags, mids * (1 + 1e-6), mids * (1 - 1e-6),
                        [0.0, 1.0]]).astype(np.float32)
    a = np.clip(a, 0, 1)
    code = np.asarray(R.encode(jnp.asarray(a), dmap))
    best = np.min(np.abs(a[:, None].astype(np.float64) - mags[None, :]), axis=1)
    np.testing.assert_array_equal(np.abs(mags[code].astype(np.float64) - a), best)


def _fp32_sweep(dmap, stride):
    """Every `stride`-th fp32 in [0, 1] (and a little over 1), plus every fp32 within 40 ulps of each
    boundary of the encoder (decade bounds) and of each exact midpoint between codes."""
    one = int(np.float32(1.0).view(np.uint32))
    mags = (dmap.table[:128] if dmap.signed else dmap.table).astype(np.float64)
    mids = np.float32((mags[1:] + mags[:-1]) / 2)
    cuts = np.float32([*dmap.bounds, dmap.one_bound])
    centers = np.concatenate([mids, cuts, np.float32(mags)]).view(np.uint32).astype(np.int64)
    near = (centers[:, None] + np.arange(-40, 41)[None, :]).reshape(-1)
    bits = np.concatenate([np.arange(0, one + 40, stride), near, [0, 1, one - 1, one, one + 1]])
    return np.clip(bits, 0, None).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dmap,tables", [(R.SIGNED_MAP, R.SIGNED_BINADES), (R.UNSIGNED_MAP, R.UNSIGNED_BINADES)],
                         ids=["signed", "unsigned"])
def test_encode_binade_is_encode_signed(dmap, tables):
    """The binade-indexed encoder (sign, abs and clip folded into its tables) against `encode_signed` on the
    same sweep (dense over [0, 1], every value near a decade bound or a midpoint between codes), both signs for
    the signed map (-0 and negative denormals included); an exhaustive sweep of all fp32 in [-1, 1] found no
    difference either."""
    a = _fp32_sweep(dmap, stride=251)
    x = jnp.asarray(np.concatenate([a, -a]) if dmap.signed else a)
    one = jnp.float32(1.0)
    ref = jax.jit(lambda x: R.encode_signed(x, one, dmap))(x)
    out = jax.jit(lambda x: R.encode_binade(x * one, *R.table_lookups(tables)))(x)
    bad = np.flatnonzero(np.asarray(ref) != np.asarray(out))
    assert bad.size == 0, (np.asarray(x)[bad[:5]], np.asarray(ref)[bad[:5]], np.asarray(out)[bad[:5]])


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_encoders_in_kernel_are_encode(signed):
    """The kernel's own table operands and lookups (interpret mode) against `encode`: quantize with the kernel
    (zero state, b1 = b2 = 0 so m_new = g and v_new = g*g) values at every code, on both sides of every
    midpoint between codes and of every decade bound (2e-5 away: XLA:CPU contracts a * A + C to an FMA in
    jit but not eagerly, which moves codes only within a few ulps of a midpoint), and log-uniform values."""
    dmap = R.SIGNED_MAP if signed else R.UNSIGNED_MAP
    mags = (dmap.table[:128] if dmap.signed else dmap.table).astype(np.float64)
    mids = (mags[1:] + mags[:-1]) / 2
    cuts = np.asarray([*dmap.bounds, dmap.one_bound], np.float64)
    rand_mags = 10.0 ** np.random.default_rng(0).uniform(-8, 0, 3000)
    a = np.concatenate([mags, mids * (1 - 2e-5), mids * (1 + 2e-5), cuts * (1 - 2e-5), cuts * (1 + 2e-5),
                        rand_mags, [0.0, 1e-30, 1e-9]]).astype(np.float32)
    if signed:
        a = np.concatenate([a, -a])
    a = np.concatenate([a, np.zeros(-a.size % 255, np.float32)])
    # each block: 255 of the values and a 1.0 (the absmax, so a * inv_absmax == a exactly)
    blocks = np.concatenate([a.reshape(-1, 255), np.ones((a.size // 255, 1), np.float32)], axis=1).reshape(-1)
    vals = jnp.asarray(blocks)
    g = vals if signed else jnp.sqrt(vals)
    vals = g if signed else g * g  # what the kernel quantizes
    nb = blocks.size // 256
    zc, za = jnp.zeros((nb * 256,), jnp.uint8), jnp.zeros((nb,), jnp.float32)
    s = K.scalar_operand([-1e-3, 0.0, 1.0, 0.0, 1.0, 1e-8, 0.0, 0.0, 1.0, 1.0])
    out = K.adam_q8(s, g, zc, za, zc, za, inplace=False, interpret=True)
    ref, _ = R.quantize_blockwise(vals, signed)
    np.testing.assert_array_equal(np.asarray(out[1] if signed else out[3]), np.asarray(ref))
    assert len(np.unique(np.asarray(ref))) == 256  # every code is hit


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_round_trip(signed):
    x = rand(1, (37, 129), scale=3.0)
    x = x if signed else x * x
    codes, absmax = R.quantize_blockwise(x, signed)
    assert codes.dtype == jnp.uint8 and codes.shape == (R.num_blocks(x.size) * 256,)
    back = R.dequantize_blockwise(codes, absmax, x.shape, signed)
    # Error per element at most half the largest gap of the map (0.9/64/2 of the block absmax).
    blocks = jnp.pad(jnp.abs(x).reshape(-1), (0, codes.size - x.size)).reshape(-1, 256).max(axis=1)
    bound = jnp.repeat(blocks, 256)[: x.size].reshape(x.shape) * (0.9 / 64 / 2 * 1.001)
    assert bool(jnp.all(jnp.abs(back - x) <= bound))
    assert float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x)) < 0.02


def _close(out, ref, what):
    """Max error within a few ulps of the storage dtype, relative to the largest reference value."""
    tol = 4e-7 if jnp.dtype(out.dtype) == jnp.float32 else 8e-3
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("n,dtype,mu_dtype", [(1, jnp.float32, jnp.float32), (5003, jnp.float32, jnp.float32),
                                              (5003, jnp.bfloat16, jnp.bfloat16), (300, jnp.float32, jnp.bfloat16)])
def test_fp32_state_kernel_matches_reference(n, dtype, mu_dtype):
    g, p = rand(0, (n,), dtype), rand(1, (n,), dtype)
    m, v = rand(2, (n,), mu_dtype, scale=0.1), (rand(3, (n,)) ** 2).astype(dtype)
    s = _scalars()
    for inplace, pp in ((False, None), (False, p), (True, p)):
        out = K.adam_fp32(s, g, m, v, pp, inplace=inplace, interpret=True)
        ref = R.adam_leaf_reference(g, m, v, s, pp, inplace=inplace)
        for o, r, name in zip(out, ref, ("out", "m", "v")):
            assert o.dtype == r.dtype and o.shape == r.shape, name
            assert_all_written(o, name)
            _close(o, r, f"{name} inplace={inplace} p={pp is not None}")


def test_fp32_kernel_skips_non_finite_elements():
    n = 3000
    g, p, m = rand(0, (n,)), rand(1, (n,)), rand(2, (n,), scale=0.1)
    v = rand(3, (n,)) ** 2
    bad = jnp.zeros((n,), bool).at[jnp.array([0, 5, 2999])].set(True)
    g = jnp.where(bad, jnp.array([jnp.nan, jnp.inf, -jnp.inf]).repeat(1000), g)
    g = g.at[10].set(1e30)  # g * g overflows
    bad = bad.at[10].set(True)
    p2, m2, v2 = K.adam_fp32(_scalars(), g, m, v, p, inplace=True, interpret=True)
    for new, old in ((p2, p), (m2, m), (v2, v)):
        assert_all_written(new)
        np.testing.assert_array_equal(np.asarray(new)[np.asarray(bad)], np.asarray(old)[np.asarray(bad)])
        assert bool(jnp.all((new != old)[~bad]))


def _q8_inputs(n, seed=0, dtype=jnp.float32):
    g, p = rand(seed, (n,), dtype), rand(seed + 1, (n,), dtype)
    mc, ma = R.quantize_blockwise(rand(seed + 2, (n,), scale=0.1), True)
    vc, va = R.quantize_blockwise(rand(seed + 3, (n,)) ** 2 * 0.01, False)
    return g, p, mc, ma, vc, va


@pytest.mark.parametrize("n,dtype", [(5003, jnp.float32), (4096, jnp.bfloat16)])
def test_q8_kernel_matches_reference(n, dtype):
    g, p, mc, ma, vc, va = _q8_inputs(n, dtype=dtype)
    g = g.at[17].set(jnp.nan)
    s = _scalars()
    for inplace, pp in ((False, None), (True, p)):
        out = K.adam_q8(s, g, mc, ma, vc, va, pp, inplace=inplace, interpret=True)
        ref = R.adam_leaf_reference_q8(g, mc, ma, vc, va, s, pp, inplace=inplace)
        for o, r, name in zip(out, ref, ("out", "mc", "ma", "vc", "va")):
            assert o.dtype == r.dtype and o.shape == r.shape, name
            assert_all_written(o, name)
            if o.dtype == jnp.uint8:
                # Codes may differ by one where a value sits on a rounding boundary.
                diff = np.abs(np.asarray(o, np.int32) - np.asarray(r, np.int32))
                assert np.mean(diff != 0) < 1e-3 and diff.max() <= 1, name
            else:
                _close(o, r, name)
        assert float(out[0][17]) == (0.0 if pp is None else float(p[17]))


def test_q8_step_tracks_fp32_step():
    """One 8-bit step is the fp32 step on the dequantized state, up to the map's rounding."""
    n = 4500
    g, p, mc, ma, vc, va = _q8_inputs(n, seed=5)
    s = _scalars(t=10)
    m = R.dequantize_blockwise(mc, ma, (n,), True)
    v = R.dequantize_blockwise(vc, va, (n,), False)
    p8, mc2, ma2, vc2, va2 = K.adam_q8(s, g, mc, ma, vc, va, p, inplace=True, interpret=True)
    p32, m32, v32 = R.adam_leaf_reference(g, m, v, s, p, inplace=True)
    np.testing.assert_allclose(np.asarray(p8), np.asarray(p32), rtol=1e-6, atol=1e-7)
    m8 = R.dequantize_blockwise(mc2, ma2, (n,), True)
    v8 = R.dequantize_blockwise(vc2, va2, (n,), False)
    assert float(jnp.linalg.norm(m8 - m32) / jnp.linalg.norm(m32)) < 0.02
    assert float(jnp.linalg.norm(v8 - v32) / jnp.linalg.norm(v32)) < 0.02


def test_inplace_kernel_under_donation():
    n = 4099
    g, p, m = rand(0, (n,)), rand(1, (n,)), rand(2, (n,), scale=0.1)
    v = rand(3, (n,)) ** 2
    s = _scalars()
    expected = R.adam_leaf_reference(g, m, v, s, p, inplace=True)
    step = jax.jit(lambda s, p, g, m, v: K.adam_fp32(s, g, m, v, p, inplace=True, interpret=True),
                   donate_argnums=(1, 3, 4))
    out = step(s, p + 0, g, m + 0, v + 0)
    for o, r in zip(out, expected):
        _close(o, r, "donated")


@pytest.mark.parametrize("mode", ["plain", "volatile"])  # evict_first is the default, tested above
def test_load_modes_match_reference(mode):
    """Every way of issuing the streaming loads (swept by benchmarks/bench_adam.py) computes the same step,
    non-finite gradients included, for a block/row count that leaves a masked tail."""
    n = 1500
    g, p, m = rand(0, (n,)), rand(1, (n,)), rand(2, (n,), scale=0.1)
    v = rand(3, (n,)) ** 2
    g = g.at[7].set(jnp.nan)
    s = _scalars()
    out = K.adam_fp32(s, g, m, v, p, inplace=True, interpret=True, launch=K.Launch(512, 2, mode))
    for o, r, name in zip(out, R.adam_leaf_reference(g, m, v, s, p, inplace=True), ("p", "m", "v")):
        assert_all_written(o, name)
        _close(o, r, f"{name} {mode}")
    g8, p8, mc, ma, vc, va = _q8_inputs(n, seed=3)
    ref = R.adam_leaf_reference_q8(g8, mc, ma, vc, va, s, p8, inplace=True)
    out = K.adam_q8(s, g8, mc, ma, vc, va, p8, inplace=True, interpret=True, launch=K.Launch(256, 2, mode))
    _close(out[0], ref[0], f"p 8-bit {mode}")
    for o, r in zip(out[1:], ref[1:]):
        if o.dtype == jnp.uint8:
            assert np.max(np.abs(np.asarray(o, np.int32) - np.asarray(r, np.int32))) <= 1
        else:
            _close(o, r, f"absmax 8-bit {mode}")


def test_bad_launch():
    with pytest.raises(ValueError, match="load_mode: expected one of"):
        K.Launch(load_mode="streaming")
    g, p, mc, ma, vc, va = _q8_inputs(300)
    with pytest.raises(ValueError, match="launch: the 8-bit kernel handles one block of 256"):
        K.adam_q8(_scalars(), g, mc, ma, vc, va, p, inplace=True, interpret=True, launch=K.Launch(512, 1))


def _assert_q8_close(out, ref):
    """Compiled 8-bit step against the reference: a rare code may flip across a rounding boundary (FMA
    contraction and fast division differ by ulps), never by more than one step of the map."""
    for o, r, name in zip(out, ref, ("p", "mc", "ma", "vc", "va")):
        assert_all_written(o, name)
        if o.dtype == jnp.uint8:
            diff = np.abs(np.asarray(o, np.int32) - np.asarray(r, np.int32))
            assert np.mean(diff != 0) < 1e-3 and diff.max() <= 1, name
        else:
            np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=2e-5, atol=1e-8, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("block,warps,mode", [(4096, 8, "volatile"), (1024, 4, "plain"), (512, 4, "volatile")])
def test_gpu_fp32_kernel_variants(block, warps, mode):
    """The swept launch variants of the fp32 kernel against the reference on the GPU (tail included)."""
    n = 4096 * 256 + 17
    g, p, m = rand(0, (n,)), rand(1, (n,)), rand(2, (n,), scale=0.1)
    v = rand(3, (n,)) ** 2
    s = _scalars()
    out = jax.jit(lambda *a: K.adam_fp32(*a, inplace=True, interpret=False, launch=K.Launch(block, warps, mode)))(
        s, g, m, v, p)
    ref = jax.jit(lambda *a: R.adam_leaf_reference(*a, inplace=True))(g, m, v, s, p)
    for o, r in zip(out, ref):
        assert_all_written(o)
        assert rel_err(o, np.asarray(r, np.float64)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("warps,mode", [(1, "volatile"), (2, "plain"), (2, "evict_first")])
def test_gpu_q8_kernel_launches(warps, mode):
    n = 4096 * 256 + 17
    g, p, mc, ma, vc, va = _q8_inputs(n)
    s = _scalars()
    out = jax.jit(lambda *a: K.adam_q8(*a, inplace=True, interpret=False, launch=K.Launch(256, warps, mode)))(
        s, g, mc, ma, vc, va, p)
    ref = jax.jit(lambda *a: R.adam_leaf_reference_q8(*a, inplace=True))(g, mc, ma, vc, va, s, p)
    _assert_q8_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096 * 1024 + 17, 105 * 1024 * 1024 // 4])
def test_gpu_fp32_kernel_large(n):
    g, p, m = rand(0, (n,)), rand(1, (n,)), rand(2, (n,), scale=0.1)
    v = rand(3, (n,)) ** 2
    s = _scalars()
    out = jax.jit(lambda *a: K.adam_fp32(*a, inplace=True, interpret=False))(s, g, m, v, p)
    ref = jax.jit(lambda *a: R.adam_leaf_reference(*a, inplace=True))(g, m, v, s, p)
    for o, r in zip(out, ref):
        assert_all_written(o)
        # Triton's fp32 division and sqrt may be a few ulps off XLA's, and FMA contraction differs: compare
        # norm-wise (an elementwise rtol fails on the few m = b1 m + (1-b1) g that cancel to near zero).
        assert rel_err(o, np.asarray(r, np.float64)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096 * 1024 + 17, 105 * 1024 * 1024 // 4])
def test_gpu_q8_kernel_large(n):
    g, p, mc, ma, vc, va = _q8_inputs(n)
    s = _scalars()
    out = jax.jit(lambda *a: K.adam_q8(*a, inplace=True, interpret=False))(s, g, mc, ma, vc, va, p)
    ref = jax.jit(lambda *a: R.adam_leaf_reference_q8(*a, inplace=True))(g, mc, ma, vc, va, s, p)
    _assert_q8_close(out, ref)
