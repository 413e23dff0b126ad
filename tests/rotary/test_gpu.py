"""GPU checks of the compiled kernel at the benchmark shapes and beyond (skipped without a CUDA GPU).

At these sizes the "exact" reference is the reference computed in float32 on the device (its error,
~1e-7, is far below bf16's 4e-3); the baseline is the bf16 XLA reference, as in tests.helpers' rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.rotary import RotaryScaling, apply_rotary, inv_frequencies, reference_rotary
from tests.helpers import assert_all_written, assert_close, rand, rel_err, to64
from tests.rotary.rope64 import rope64, rope_fp32

pytestmark = pytest.mark.gpu


def _exact32(x, positions, **kw):
    return to64(reference_rotary(x.astype(jnp.float32), None, positions, **kw)[0])


@pytest.mark.parametrize("shape", [(4, 4096, 32, 8, 128), (8, 2048, 32, 32, 128)], ids=str)
def test_benchmark_shapes_forward_and_backward(shape):
    batch, seq_len, hq, hk, d = shape
    q, k = rand(0, (batch, seq_len, hq, d), jnp.bfloat16), rand(1, (batch, seq_len, hk, d), jnp.bfloat16)
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    fwd = jax.jit(lambda q, k: apply_rotary(q, k, pos, implementation="pallas"))
    fwd_ref = jax.jit(lambda q, k: apply_rotary(q, k, pos, implementation="xla"))
    out, ref = fwd(q, k), fwd_ref(q, k)
    for x, o, r in zip((q, k), out, ref):
        assert_all_written(o, "fwd")
        assert_close(o, _exact32(x, pos, rotary_dim=d), baseline=r, what=f"fwd {shape}")
    gq, gk = rand(2, q.shape, jnp.bfloat16), rand(3, k.shape, jnp.bfloat16)
    bwd = jax.jit(lambda q, k, g: jax.vjp(lambda q, k: apply_rotary(q, k, pos, implementation="pallas"), q, k)[1](g))
    bwd_ref = jax.jit(lambda q, k, g: jax.vjp(lambda q, k: reference_rotary(q, k, pos, rotary_dim=d), q, k)[1](g))
    grads, grads_ref = bwd(q, k, (gq, gk)), bwd_ref(q, k, (gq, gk))
    for g, o, r in zip((gq, gk), grads, grads_ref):
        exact = to64(reference_rotary(g.astype(jnp.float32), None, pos, rotary_dim=d, inverse=True)[0])
        assert_close(o, exact, baseline=r, what=f"bwd {shape}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32-precise", "bfloat16-fast"])
def test_decode_long_context_positions(dtype):
    """S=1 per row, each row at its own position in [2^20, 2^31): the exact angle reduction keeps the compiled
    kernel (libdevice cos/sin for fp32, sin/cos.approx for bf16) within one rounding of float64, where fp32
    angles would be off by up to a whole turn."""
    batch, hq, hk, d = 64, 32, 8, 128
    q, k = rand(4, (batch, 1, hq, d), dtype), rand(5, (batch, 1, hk, d), dtype)
    pos = jax.random.randint(jax.random.key(6), (batch, 1), 2**20, 2**31 - 1, dtype=jnp.int32).at[0, 0].set(2**24)
    out = jax.jit(lambda q, k, p: apply_rotary(q, k, p, implementation="pallas"))(q, k, pos)
    inv64 = inv_frequencies(d)
    floor = 2e-6 if dtype == jnp.float32 else 8e-3
    for x, o in zip((q, k), out):
        exact = rope64(x, pos, inv64, rotary_dim=d)
        assert rel_err(o, exact) <= floor, rel_err(o, exact)


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 80), (96, 96), (128, 64), (192, 192), (256, 128)])
@pytest.mark.parametrize("layout,interleaved", [("bshd", False), ("bhsd", True)])
def test_head_dims_layouts_float64(head_dim, rotary_dim, layout, interleaved):
    batch, seq_len, hq, hk = 3, 333, 6, 2
    shape = (lambda h: (batch, seq_len, h, head_dim)) if layout == "bshd" else (lambda h: (batch, h, seq_len, head_dim))
    q, k = rand(7, shape(hq), jnp.bfloat16), rand(8, shape(hk), jnp.bfloat16)
    pos = jax.random.randint(jax.random.key(9), (batch, seq_len), 0, 32768, dtype=jnp.int32)
    spec = RotaryScaling.yarn(4.0, 8192)
    out = apply_rotary(q, k, pos, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout, scaling=spec,
                       implementation="pallas")
    inv64 = inv_frequencies(rotary_dim, 10000.0, spec)
    conv = dict(rotary_dim=rotary_dim, interleaved=interleaved, layout=layout, scale=spec.attention_scale())
    for x, o in zip((q, k), out):
        assert_close(o, rope64(x, pos, inv64, **conv), baseline=rope_fp32(x, pos, inv64, **conv),
                     what=f"D={head_dim} R={rotary_dim} {layout}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_dtypes_and_vmap_on_gpu(dtype):
    q, k = rand(10, (3, 2, 257, 4, 128), dtype), rand(11, (3, 2, 257, 1, 128), dtype)
    pos = jnp.arange(257, dtype=jnp.int32)
    out = jax.jit(jax.vmap(lambda q, k: apply_rotary(q, k, pos, implementation="pallas")))(q, k)
    ref = jax.vmap(lambda q, k: apply_rotary(q, k, pos, implementation="xla"))(q, k)
    for x, o, r in zip((q, k), out, ref):
        exact = np.stack([_exact32(x[i], pos, rotary_dim=128) for i in range(3)])
        assert_close(o, exact, baseline=r, what=f"vmap {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("trig,load_mode,warps", [("fast", "plain", 4), ("fast", "volatile", 4), ("fast", "plain", 2),
                                                  ("precise", "volatile", 4), ("precise", "evict_first", 4)])
def test_swept_configs_on_gpu(trig, load_mode, warps):
    """The configs benchmarks/bench_rotary.py sweeps (sin/cos.approx inline asm, volatile loads) compile and
    are as accurate as the bf16 XLA reference, at the benchmark shape and at positions near 1e6 (float64
    ground truth there), forward and backward."""
    from pallas_fused.rotary.api import apply_rotary_with_config
    from pallas_fused.rotary.kernel import LaunchConfig

    batch, seq_len, hq, hk, d = 4, 4096, 32, 8, 128
    q, k = rand(12, (batch, seq_len, hq, d), jnp.bfloat16), rand(13, (batch, seq_len, hk, d), jnp.bfloat16)
    config = LaunchConfig(1, hq, hk, 1, warps, trig=trig, load_mode=load_mode)
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    fwd = jax.jit(lambda q, k: apply_rotary_with_config(q, k, pos, implementation="pallas", config=config))
    ref = jax.jit(lambda q, k: apply_rotary(q, k, pos, implementation="xla"))(q, k)
    for x, o, r in zip((q, k), fwd(q, k), ref):
        assert_all_written(o)
        assert_close(o, _exact32(x, pos, rotary_dim=d), baseline=r, what=f"{config}")
    g = (rand(14, q.shape, jnp.bfloat16), rand(15, k.shape, jnp.bfloat16))
    grads = jax.jit(lambda q, k, g: jax.vjp(
        lambda q, k: apply_rotary_with_config(q, k, pos, implementation="pallas", config=config), q, k)[1](g))(q, k, g)
    for gx, o in zip(g, grads):
        exact = to64(reference_rotary(gx.astype(jnp.float32), None, pos, rotary_dim=d, inverse=True)[0])
        base = reference_rotary(gx, None, pos, rotary_dim=d, inverse=True)[0]
        assert_close(o, exact, baseline=base, what=f"bwd {config}")
    # Far positions (decode-like): against float64, as the fp32 reference rounded to bf16.
    small_q, small_k = q[:2, :64], k[:2, :64]
    far = jax.random.randint(jax.random.key(16), (2, 64), 100_000, 1_000_001, dtype=jnp.int32)
    out = apply_rotary_with_config(small_q, small_k, far, implementation="pallas",
                                   config=LaunchConfig(1, hq, hk, 1, warps, trig=trig, load_mode=load_mode))
    inv64 = inv_frequencies(d)
    for x, o in zip((small_q, small_k), out):
        assert_close(o, rope64(x, far, inv64, rotary_dim=d), baseline=rope_fp32(x, far, inv64, rotary_dim=d),
                     what=f"far {config}")
