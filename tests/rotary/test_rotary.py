"""apply_rotary: the Pallas kernel (interpreted on CPU) against a float64 numpy ground truth, for every knob."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from pallas_fused.rotary import RotaryScaling, apply_rotary, inv_frequencies, reference_rotary
from pallas_fused.rotary.api import apply_rotary_with_config
from pallas_fused.rotary.kernel import LaunchConfig, choose_config
from tests.helpers import DTYPES, FLOOR, assert_close, odd_dims, rand, rel_err, to64
from tests.rotary.rope64 import hf_inv_freq, rope64, rope_fp32


def make(seed, batch, seq_len, hq, hk, d, dtype=jnp.float32, layout="bshd"):
    shape = (lambda h: (batch, seq_len, h, d)) if layout == "bshd" else (lambda h: (batch, h, seq_len, d))
    q = rand(seed, shape(hq), dtype)
    k = None if hk is None else rand(seed + 1, shape(hk), dtype)
    return q, k


def rand_positions(seed, shape, high=4096):
    return jax.random.randint(jax.random.key(seed), shape, 0, high, dtype=jnp.int32)


def check(impl, q, k, positions, *, rotary_dim=None, interleaved=False, base=10000.0, scaling=None, layout="bshd",
          what="", inv_freq64=None, scale=1.0):
    """Run `impl`, compare q and k to float64 (baseline: the same-precision numpy fp32 rotation); return outputs."""
    d = q.shape[-1]
    rd = d if rotary_dim is None else rotary_dim
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, base=base, scaling=scaling, layout=layout)
    out = apply_rotary(q, k, positions, implementation=impl, **kw)
    if inv_freq64 is None:
        inv_freq64, scale = hf_inv_freq(rd, base)
    conv = dict(rotary_dim=rd, interleaved=interleaved, layout=layout, scale=scale)
    for name, x, o in (("q", q, out[0]), ("k", k, out[1])):
        if x is None:
            assert o is None
            continue
        assert o.shape == x.shape and o.dtype == x.dtype, (name, o.shape, o.dtype)
        exact = rope64(x, positions, inv_freq64, **conv)
        assert_close(o, exact, baseline=rope_fp32(x, positions, inv_freq64, **conv), what=f"{what} {name}")
    return out


# ---------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout,interleaved", [("bshd", False), ("bhsd", True)], ids=["bshd_half", "bhsd_interleaved"])
def test_matches_float64(kernel_impl, dtype, layout, interleaved):
    q, k = make(0, 2, 7, 4, 2, 64, dtype, layout)
    check(kernel_impl, q, k, rand_positions(1, (2, 7)), interleaved=interleaved, layout=layout,
          what=f"{layout} interleaved={interleaved}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_xla_implementation_matches_float64(dtype):
    """The reference is a public implementation ("xla") too: same rule, all knobs at once."""
    q, k = make(40, 2, 7, 4, 2, 96, dtype, "bhsd")
    for interleaved in (False, True):
        check("xla", q, k, rand_positions(41, (2, 7)), rotary_dim=64, interleaved=interleaved, layout="bhsd")
    spec, hf = SCALINGS["yarn"]
    inv64, attn = hf_inv_freq(96, 10000.0, **hf)
    check("xla", q, k, rand_positions(42, (7,)), scaling=spec, layout="bhsd", inv_freq64=inv64, scale=attn)


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256),
                                                 (80, 48), (128, 64), (64, 2)])
def test_head_dims_and_partial_rotary(kernel_impl, head_dim, rotary_dim):
    q, k = make(2, 3, 5, 3, 1, head_dim, jnp.bfloat16)
    check(kernel_impl, q, k, rand_positions(3, (5,)), rotary_dim=rotary_dim, what=f"D={head_dim} R={rotary_dim}")


@pytest.mark.parametrize("interleaved,layout", [(True, "bhsd"), (False, "bhsd")])
def test_partial_rotary_other_conventions(kernel_impl, interleaved, layout):
    q, k = make(4, 2, 6, 2, 2, 96, jnp.float16, layout)
    check(kernel_impl, q, k, rand_positions(5, (2, 6)), rotary_dim=40, interleaved=interleaved, layout=layout,
          what=f"R=40 {layout} interleaved={interleaved}")


@pytest.mark.parametrize("positions", ["none", "shared", "batched"])
def test_positions_forms(kernel_impl, positions):
    q, k = make(6, 3, 9, 2, 2, 64)
    pos = {"none": None, "shared": rand_positions(7, (9,)), "batched": rand_positions(8, (3, 9))}[positions]
    check(kernel_impl, q, k, pos, what=f"positions={positions}")


def test_positions_1s_is_shared():
    q, k = make(33, 3, 6, 2, 1, 32)
    pos = rand_positions(34, (6,))
    a = apply_rotary(q, k, pos[None], implementation="xla")
    b = apply_rotary(q, k, pos, implementation="xla")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (5, 1), (3, None)], ids=["mha", "gqa", "mqa", "k_none"])
def test_heads(kernel_impl, hq, hk):
    q, k = make(10, 2, 5, hq, hk, 64, jnp.bfloat16)
    out = check(kernel_impl, q, k, rand_positions(11, (2, 5)), what=f"Hq={hq} Hk={hk}")
    if hk is None:
        assert out[1] is None


@settings(max_examples=4, deadline=None, derandomize=True)
@given(batch=odd_dims(1, 5), seq_len=odd_dims(1, 19), hq=odd_dims(1, 5), hk=odd_dims(1, 3),
       layout=st.sampled_from(["bshd", "bhsd"]))
def test_odd_shapes(batch, seq_len, hq, hk, layout):
    impl = "pallas" if jax.devices()[0].platform == "gpu" else "interpret"
    q, k = make(12, batch, seq_len, hq, hk, 64, jnp.float32, layout)
    check(impl, q, k, rand_positions(13, (batch, seq_len)), layout=layout, what=f"{batch}x{seq_len} {hq}/{hk}")


@pytest.mark.parametrize("config", [LaunchConfig(4, 2, 1, 2, 4), LaunchConfig(2, 1, 1, 4, 2),
                                    LaunchConfig(8, 4, 4, 1, 1)], ids=str)
def test_launch_configs(kernel_impl, config):
    """Several tokens per program with a ragged last block, and heads split over programs (chunks)."""
    q, k = make(14, 2, 7, 3, 2, 64)
    pos = rand_positions(15, (2, 7))
    out = apply_rotary_with_config(q, k, pos, implementation=kernel_impl, config=config)
    inv64 = hf_inv_freq(64, 10000.0)[0]
    for o, x in zip(out, (q, k)):
        exact = rope64(x, pos, inv64, rotary_dim=64)
        assert_close(o, exact, baseline=rope_fp32(x, pos, inv64, rotary_dim=64), what=str(config))


def test_angle_reduction_is_exact_at_every_int32_position():
    """reduced_angle(p, angle_table(f)) is p * f modulo 2 pi to ~1e-6 rad for every int32 position (negative ones
    included), where an fp32 product p * f is off by ~0.06 rad at 2^20 and by a whole turn at 2^24."""
    import decimal

    from pallas_fused.rotary.reference import angle_table, reduced_angle

    inv = inv_frequencies(128, 500000.0)[::7]
    rng = np.random.default_rng(0)
    pos = np.concatenate([rng.integers(-2**31, 2**31, 48), rng.integers(0, 2**24, 48), rng.integers(0, 4096, 16),
                          [0, 1, -1, 2**20, 2**24, 2**24 + 1, 2**31 - 1, -2**31]]).astype(np.int32)
    rows = [jnp.asarray(r) for r in angle_table(inv)]
    got = np.asarray(reduced_angle(jnp.asarray(pos)[:, None], rows), np.float64)
    assert np.all(np.abs(got) <= np.pi + 1e-6)
    two_pi = decimal.Decimal("6.28318530717958647692528676655900576839433879875021")
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        exact = np.array([[float((decimal.Decimal(int(p)) * decimal.Decimal(float(f))) % two_pi) for f in inv]
                          for p in pos])
    err = np.abs(np.angle(np.exp(1j * (got - exact))))  # difference modulo 2 pi
    assert np.max(err) < 1e-6, np.max(err)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_long_context_positions_match_float64(kernel_impl, dtype):
    """Positions up to 2^24 (and int32's end): the rotation is as accurate as at position 0, forward and backward,
    for the kernel and the reference alike (an fp32 angle would be off by up to a whole turn here)."""
    batch, seq_len, d = 2, 8, 128
    q, k = make(16, batch, seq_len, 2, 1, d, dtype)
    pos = jax.random.randint(jax.random.key(17), (batch, seq_len), 2**20, 2**24 + 1, dtype=jnp.int32)
    pos = pos.at[0, 0].set(2**24).at[0, 1].set(2**31 - 1).at[1, 0].set(2**20)
    inv64 = inv_frequencies(d)
    angle32 = (np.asarray(pos, np.float32)[..., None] * inv64.astype(np.float32)).astype(np.float64)
    floor = FLOOR[jnp.dtype(dtype)]
    for impl in (kernel_impl, "xla"):
        out = apply_rotary(q, k, pos, implementation=impl)
        for x, o in ((q, out[0]), (k, out[1])):
            exact = rope64(x, pos, inv64, rotary_dim=d)
            assert rel_err(rope64(x, pos, inv64, rotary_dim=d, angle=angle32), exact) > 0.1  # what fp32 angles give
            assert rel_err(o, exact) <= floor, (impl, rel_err(o, exact))
        g = (rand(18, q.shape, dtype), rand(19, k.shape, dtype))
        grads = jax.vjp(lambda q, k, impl=impl: apply_rotary(q, k, pos, implementation=impl), q, k)[1](g)
        inv_pos = rope64(g[0], pos, -inv64, rotary_dim=d)  # the transpose: rotation by -angle
        assert rel_err(grads[0], inv_pos) <= floor, (impl, rel_err(grads[0], inv_pos))


@pytest.mark.parametrize("dtype,load_mode", [(jnp.bfloat16, "plain"), (jnp.float16, "volatile")],
                         ids=["bf16-plain", "f16-volatile"])
def test_fast_trig_and_load_modes(kernel_impl, dtype, load_mode):
    """trig="fast" (range reduction + approximate sin/cos) for 16-bit q/k, with each load mode: as accurate as
    the fp32 reference rounded to the dtype, positions up to 1e6 included; forward and backward."""
    q, k = make(20, 2, 9, 3, 2, 64, dtype)
    pos = jax.random.randint(jax.random.key(21), (2, 9), 0, 1_000_001, dtype=jnp.int32).at[0, 0].set(1_000_000)
    config = LaunchConfig(4, 4, 2, 1, 2, trig="fast", load_mode=load_mode)  # 4 tokens: a ragged last block
    out = apply_rotary_with_config(q, k, pos, implementation=kernel_impl, config=config)
    inv64 = hf_inv_freq(64, 10000.0)[0]
    for o, x in zip(out, (q, k)):
        exact = rope64(x, pos, inv64, rotary_dim=64)
        assert_close(o, exact, baseline=rope_fp32(x, pos, inv64, rotary_dim=64), what=f"fast {load_mode}")
    g = (rand(22, q.shape, dtype), rand(23, k.shape, dtype))
    grads = jax.vjp(lambda q, k: apply_rotary_with_config(q, k, pos, implementation=kernel_impl, config=config),
                    q, k)[1](g)
    grads_ref = jax.vjp(lambda q, k: reference_rotary(q, k, pos, rotary_dim=64), q, k)[1](g)
    for o, r in zip(grads, grads_ref):
        assert rel_err(o, to64(r)) < 2 * FLOOR[jnp.dtype(dtype)] + 1e-2


def test_fast_trig_is_not_used_for_fp32(kernel_impl):
    """An explicit trig="fast" with fp32 q runs the precise cos/sin: the same bits as the default."""
    q, k = make(24, 1, 5, 2, 1, 64)
    pos = rand_positions(25, (1, 5), high=1_000_000)
    fast = apply_rotary_with_config(q, k, pos, implementation=kernel_impl,
                                    config=LaunchConfig(4, 2, 1, 1, 2, trig="fast"))
    precise = apply_rotary_with_config(q, k, pos, implementation=kernel_impl, config=LaunchConfig(4, 2, 1, 1, 2))
    for a, b in zip(fast, precise):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------- scalings

SCALINGS = {
    "linear": (RotaryScaling.linear(8.0), dict(kind="linear", factor=8.0)),
    "llama3": (RotaryScaling.llama3(8.0, 1.0, 4.0, 8192),
               dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192)),
    "llama3_small_ctx": (RotaryScaling.llama3(4.0, 2.0, 8.0, 256),
                         dict(kind="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original=256)),
    "yarn": (RotaryScaling.yarn(4.0, original_max_position_embeddings=4096),
             dict(kind="yarn", factor=4.0, original=4096)),
    "yarn_betas": (RotaryScaling.yarn(16.0, 2048, beta_fast=16.0, beta_slow=2.0),
                   dict(kind="yarn", factor=16.0, original=2048, beta_fast=16.0, beta_slow=2.0)),
    "yarn_deepseek": (RotaryScaling.yarn(40.0, 4096, mscale=1.0, mscale_all_dim=0.707),
                      dict(kind="yarn", factor=40.0, original=4096, mscale=1.0, mscale_all_dim=0.707)),
    "yarn_attention_factor": (RotaryScaling.yarn(8.0, 4096, attention_factor=1.25),
                              dict(kind="yarn", factor=8.0, original=4096, attention_factor=1.25)),
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("dim,base", [(128, 10000.0), (64, 500000.0), (96, 1e6)])
def test_scaled_inv_freq_matches_hf(name, dim, base):
    spec, hf = SCALINGS[name]
    want, attn = hf_inv_freq(dim, base, **hf)
    np.testing.assert_allclose(inv_frequencies(dim, base, spec), want, rtol=1e-12)
    assert spec.attention_scale() == pytest.approx(attn, rel=1e-12)


def test_scaling_known_values():
    assert RotaryScaling.yarn(4.0, 4096).attention_scale() == pytest.approx(0.1 * np.log(4.0) + 1)
    assert RotaryScaling.yarn(1.0, 4096).attention_scale() == 1.0
    assert RotaryScaling.llama3().attention_scale() == 1.0
    inv, scaled = inv_frequencies(128, 500000.0), inv_frequencies(128, 500000.0, RotaryScaling.llama3())
    assert scaled[0] == inv[0]  # highest frequency: unchanged
    assert scaled[-1] == pytest.approx(inv[-1] / 8.0)  # lowest frequency: divided by factor
    np.testing.assert_allclose(inv_frequencies(64, 1e4, RotaryScaling.linear(2.0)), inv_frequencies(64, 1e4) / 2)


@pytest.mark.parametrize("name", ["linear", "llama3_small_ctx", "yarn_deepseek"])
def test_kernel_with_scaling(kernel_impl, name):
    spec, hf = SCALINGS[name]
    q, k = make(18, 2, 6, 2, 1, 64, jnp.bfloat16)
    inv64, attn = hf_inv_freq(64, 10000.0, **hf)
    check(kernel_impl, q, k, rand_positions(19, (2, 6), high=20000), scaling=spec, inv_freq64=inv64, scale=attn,
          what=name)


def test_scaling_spec_is_hashable_and_validated():
    assert hash(RotaryScaling.yarn(4.0, 4096)) == hash(RotaryScaling.yarn(4.0, 4096))
    with pytest.raises(ValueError, match="scaling: factor"):
        RotaryScaling.linear(0.0)
    with pytest.raises(ValueError, match="scaling: llama3"):
        RotaryScaling.llama3(8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="scaling: kind"):
        RotaryScaling("ntk", 2.0)


# ------------------------------------------------------------------------------------------- gradients


def _vjp_both(impl, q, k, positions, **kw):
    f = lambda q, k: apply_rotary(q, k, positions, implementation=impl, **kw)
    ref = lambda q, k: reference_rotary(q, k, positions, rotary_dim=kw.get("rotary_dim") or q.shape[-1],
                                        **{a: b for a, b in kw.items() if a != "rotary_dim"})
    out, vjp = jax.vjp(f, q, k)
    cot = tuple(None if o is None else rand(30 + i, o.shape, o.dtype) for i, o in enumerate(out))
    grads_ref = jax.jit(lambda q, k, cot: jax.vjp(ref, q, k)[1](cot))(q, k, cot)
    return vjp(cot), grads_ref, cot


@pytest.mark.parametrize("case", [
    dict(layout="bshd", interleaved=False, scaling=RotaryScaling.yarn(4.0, 64), dtype=jnp.float32),
    dict(layout="bhsd", interleaved=True, rotary_dim=32, dtype=jnp.bfloat16),
    dict(layout="bshd", interleaved=False, rotary_dim=48, dtype=jnp.float16, hk=None),
], ids=["yarn_bshd_fp32", "interleaved_bhsd_partial_bf16", "partial_knone_fp16"])
def test_grad_matches_reference_vjp(kernel_impl, case):
    case = dict(case)
    dtype, hk = case.pop("dtype"), case.pop("hk", 2)
    layout = case["layout"]
    q, k = make(20, 2, 5, 4, hk, 64, dtype, layout)
    pos = rand_positions(21, (2, 5))
    grads, grads_ref, cot = _vjp_both(kernel_impl, q, k, pos, **case)
    rd = case.get("rotary_dim") or 64
    spec = case.get("scaling")
    inv64 = inv_frequencies(rd, 10000.0, spec)
    scale = 1.0 if spec is None else spec.attention_scale()
    # The exact gradient: the transpose rotation (angle -> -angle) of the cotangent, same attention factor.
    for g, g_ref, c in zip(grads, grads_ref, cot):
        if c is None:
            assert g is None
            continue
        assert g.dtype == c.dtype
        pos64 = np.broadcast_to(np.asarray(pos, np.float64), (2, 5))
        exact = rope64(c, None, None, rotary_dim=rd, interleaved=case["interleaved"], layout=layout, scale=scale,
                       angle=-(pos64[..., None] * inv64))
        assert_close(g, exact, baseline=g_ref, what="grad")
        assert rel_err(g, to64(g_ref)) <= 2 * FLOOR[jnp.dtype(dtype)]


def test_reference_grads_numerically():
    q, k = make(22, 1, 3, 2, 1, 16)
    f = lambda q, k: reference_rotary(q, k, jnp.arange(3), rotary_dim=12, scaling=RotaryScaling.yarn(2.0, 16))
    check_grads(f, (q, k), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_backward_saves_only_positions(kernel_impl):
    q, k = make(23, 2, 4, 2, 1, 32)
    pos = rand_positions(24, (2, 4))
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

    res = saved_residuals(lambda q, k: apply_rotary(q, k, pos, implementation=kernel_impl), q, k)
    assert res, "expected the positions as a residual"
    for aval, _ in res:
        assert aval.dtype == jnp.int32 and aval.shape == pos.shape, res


# ------------------------------------------------------------------------------------ transformations


def test_jit_and_grad_under_jit(kernel_impl):
    q, k = make(25, 2, 5, 2, 2, 64)
    pos = rand_positions(26, (5,))
    f = jax.jit(lambda q, k, p: apply_rotary(q, k, p, implementation=kernel_impl))
    ref = reference_rotary(q, k, pos, rotary_dim=64)
    for o, r in zip(f(q, k, pos), ref):
        assert rel_err(o, to64(r)) <= 1e-6
    loss = lambda q, k: sum(jnp.sum(o * o) for o in apply_rotary(q, k, pos, implementation=kernel_impl))
    gq, gk = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
    # rotation preserves norms, so d/dx sum(R x)^2 = 2 x
    assert rel_err(gq, 2 * to64(q)) <= 1e-5 and rel_err(gk, 2 * to64(k)) <= 1e-5


def test_vmap(kernel_impl):
    q, k = make(27, 2, 5, 2, 1, 64)
    qs, ks = jnp.stack([q, 2 * q, -q]), jnp.stack([k, k, 3 * k])
    pos = rand_positions(28, (3, 5))  # a different position vector per vmapped example
    outs = jax.vmap(lambda q, k, p: apply_rotary(q, k, p, implementation=kernel_impl))(qs, ks, pos)
    for i in range(3):
        ref = reference_rotary(qs[i], ks[i], pos[i], rotary_dim=64)
        assert rel_err(outs[0][i], to64(ref[0])) <= 1e-6 and rel_err(outs[1][i], to64(ref[1])) <= 1e-6


def test_remat(kernel_impl):
    q, k = make(29, 2, 4, 2, 1, 64)
    pos = rand_positions(30, (2, 4))
    w = rand(31, q.shape)

    def loss(q, k):
        qr, kr = apply_rotary(q, k, pos, implementation=kernel_impl)
        return jnp.sum(jnp.sin(qr) * w) + jnp.sum(kr**3)

    g = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(q, k)
    ref_loss = lambda q, k: (lambda o: jnp.sum(jnp.sin(o[0]) * w) + jnp.sum(o[1] ** 3))(
        reference_rotary(q, k, pos, rotary_dim=64))
    g_ref = jax.grad(ref_loss, argnums=(0, 1))(q, k)
    for a, b in zip(g, g_ref):
        assert rel_err(a, to64(b)) <= 1e-5


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8)], ids=["B0", "S0", "H0"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_empty_inputs_forward_and_backward(kernel_impl, shape, layout):
    """Zero batch, tokens or heads: empty results and gradients, as nn.Dense, on every implementation."""
    if layout == "bhsd":
        shape = (shape[0], shape[2], shape[1], shape[3])
    q = jnp.zeros(shape, jnp.bfloat16)
    k = rand(1, shape[:2] + (1,) + shape[3:] if layout == "bshd" else shape[:1] + (1,) + shape[2:], jnp.bfloat16)
    seq = shape[1] if layout == "bshd" else shape[2]
    for impl in (None, "xla", kernel_impl):
        for pos in (None, jnp.arange(seq, dtype=jnp.int32)):
            out, pull = jax.vjp(lambda q, k, impl=impl, pos=pos: apply_rotary(q, k, pos, layout=layout,
                                                                              implementation=impl), q, k)
            assert out[0].shape == q.shape and out[1].shape == k.shape
            dq, dk = pull((jnp.ones_like(out[0]), jnp.ones_like(out[1])))
            assert dq.shape == q.shape and dk.shape == k.shape and np.all(np.isfinite(np.asarray(dk, np.float32)))


def test_default_implementation_on_cpu_is_reference():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("a GPU is present")
    q, k = make(32, 1, 3, 2, 1, 16)
    a = apply_rotary(q, k)
    b = reference_rotary(q, k, jnp.arange(3), rotary_dim=16)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=jnp.ones((2, 5, 2, 32))), "k: head_dim 32 must equal q's head_dim 64"),
    (dict(k=jnp.ones((2, 6, 2, 64))), "k: batch and sequence sizes"),
    (dict(k=jnp.ones((2, 5, 64))), "k: expected a 4-D array"),
    (dict(k=jnp.ones((2, 5, 2, 64), jnp.int32)), "k: expected a floating-point array"),
    (dict(rotary_dim=33), "rotary_dim: expected an even number"),
    (dict(rotary_dim=66), "rotary_dim: expected an even number in \\[2, head_dim=64\\]"),
    (dict(rotary_dim=0), "rotary_dim"),
    (dict(rotary_dim=32.0), "rotary_dim: expected an int"),
    (dict(positions=jnp.arange(6)), "positions: expected shape \\(S,\\)"),
    (dict(positions=jnp.zeros((3, 5), jnp.int32)), "positions: expected shape"),
    (dict(positions=jnp.zeros((2, 5, 1), jnp.int32)), "positions: expected shape"),
    (dict(positions=jnp.arange(5.0)), "positions: expected an integer array"),
    (dict(positions=[0, 1, 2, 3, 4]), "positions: expected an integer array"),
    (dict(layout="sbhd"), "layout: expected one of"),
    (dict(scaling="linear"), "scaling: expected None or a RotaryScaling"),
    (dict(base=-1.0), "base: expected a Python number > 1"),
    (dict(implementation="cuda"), "implementation must be None or one of"),
])
def test_bad_input_raises_naming_the_argument(kwargs, match):
    q = jnp.ones((2, 5, 4, 64), jnp.float32)
    k = kwargs.pop("k", jnp.ones((2, 5, 2, 64)))
    with pytest.raises(ValueError, match=match):
        apply_rotary(q, k, **kwargs)


def test_integer_or_wrong_rank_q_raises():
    with pytest.raises(ValueError, match="q: expected a floating-point array"):
        apply_rotary(jnp.ones((2, 5, 4, 64), jnp.int32), None)
    with pytest.raises(ValueError, match="q: expected a 4-D array of shape \\(B, H, S, D\\)"):
        apply_rotary(jnp.ones((5, 4, 64)), None, layout="bhsd")


def test_bhsd_shape_checks_use_the_layout():
    q = jnp.ones((2, 4, 5, 64))
    with pytest.raises(ValueError, match="positions: expected shape \\(S,\\)=\\(5,\\)"):
        apply_rotary(q, None, jnp.arange(4), layout="bhsd")


# ------------------------------------------------------------------------------------- launch geometry


def test_choose_config_shapes():
    # The benchmark shape: one token per program, all heads of q and k in it, 4 warps (40 elements per
    # thread): the fastest geometry measured on an H200.
    cfg = choose_config(4, 4096, 32, 8, 64, 0, 2, num_sms=132)
    assert cfg == LaunchConfig(block_tokens=1, q_heads=32, k_heads=8, num_chunks=1, num_warps=4,
                               trig="fast", load_mode="volatile")  # bf16: the fast sin/cos (H200 sweep)
    assert choose_config(4, 4096, 32, 8, 64, 0, 4, num_sms=132).trig == "precise"  # fp32 keeps libdevice
    # MHA: more heads, more warps.
    assert choose_config(8, 2048, 32, 32, 64, 0, 2, num_sms=132).num_warps == 8
    # Decode (S=1): heads split over programs so a 64-row batch still fills the GPU.
    cfg = choose_config(64, 1, 32, 8, 64, 0, 2, num_sms=132)
    assert cfg.block_tokens == 1 and 64 * cfg.num_chunks >= 2 * 132
    # Very wide tokens: heads split so a thread's share stays within the register budget.
    cfg = choose_config(1, 4096, 128, 128, 128, 0, 2, num_sms=132)
    assert cfg.block_tokens * (cfg.q_heads + cfg.k_heads) * 256 <= 96 * 32 * cfg.num_warps
    # Explicit overrides are honoured.
    cfg = choose_config(4, 4096, 32, 8, 64, 0, 2, num_sms=132, block_tokens=2, num_warps=4)
    assert (cfg.block_tokens, cfg.num_warps) == (2, 4)
    # trig="fast" only for 16-bit q/k; bad knobs raise.
    assert choose_config(4, 4096, 32, 8, 64, 0, 2, num_sms=132, trig="fast").trig == "fast"
    assert choose_config(4, 4096, 32, 8, 64, 0, 4, num_sms=132, trig="fast").trig == "precise"
    with pytest.raises(ValueError, match="trig"):
        choose_config(4, 4096, 32, 8, 64, 0, 2, num_sms=132, trig="approx")
    with pytest.raises(ValueError, match="load_mode"):
        choose_config(4, 4096, 32, 8, 64, 0, 2, num_sms=132, load_mode="streaming")
    for c in (cfg,):
        for v in (c.block_tokens, c.q_heads, c.k_heads):
            assert v & (v - 1) == 0
