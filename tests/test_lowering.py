"""Every Pallas kernel lowers for a CUDA GPU, checked without one.

CI has no GPU, and interpret mode runs a kernel's jaxpr, not its GPU lowering: a kernel can pass every
interpret test and still fail on a GPU at its first trace (a block shape Triton cannot take, a dtype a Mosaic GPU
op refuses, an index past a ref's end). jax lowers for another platform than the one it runs on, so here each
public op is exported for "cuda" under `_backend.gpu_target` of an Ampere (8.0) and a Hopper (9.0) GPU, and the
lowered module must hold the op's Pallas kernels: Triton (`__gpu$xla.gpu.triton`) or Mosaic GPU (`mosaic_gpu*`)
custom calls. What it cannot show: Triton's own compile to PTX and the kernel's speed, which happen on the GPU.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import export

from pallas_fused import _backend

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = ("mosaic_gpu", "mosaic_gpu_v2")
_ALLOWED = [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, *MOSAIC)]


@pytest.fixture(params=[(8, 0), (9, 0)], ids=["sm80", "sm90"])
def cc(request):
    """Implementations chosen and kernels lowered for a CUDA GPU of that compute capability."""
    with _backend.gpu_target(request.param):
        yield request.param


def kernels(fn, *args) -> list[str]:
    """The custom-call targets of `jit(fn)(*args)` lowered for CUDA (one entry per call)."""
    module = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=_ALLOWED)(*args).mlir_module()
    return re.findall(r"custom_call @([\w$.]+)", module)


def rnd(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def loss(fn):
    """A scalar of fn's (tuple of) outputs, for jax.grad."""
    return lambda *a: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(fn(*a)))


def test_rotary(cc):
    from pallas_fused.rotary import apply_rotary

    q, k = rnd(0, (2, 48, 4, 64), jnp.bfloat16), rnd(1, (2, 48, 2, 64), jnp.bfloat16)
    fwd = kernels(lambda q, k: apply_rotary(q, k), q, k)
    both = kernels(jax.value_and_grad(loss(lambda q, k: apply_rotary(q, k)), (0, 1)), q, k)
    assert fwd.count(TRITON) == 1 and both.count(TRITON) == 2


def test_embed_and_rms_norm(cc):
    from pallas_fused.embed import embed
    from pallas_fused.norm import rms_norm

    table, ids = rnd(0, (256, 192)), jnp.arange(300, dtype=jnp.int32).reshape(3, 100) % 256
    assert kernels(jax.value_and_grad(loss(lambda t: embed(t, ids, dtype=jnp.bfloat16))), table).count(TRITON) >= 1
    for width in (2048, 5504):
        x, scale = rnd(1, (100, width), jnp.bfloat16), rnd(2, (width,))
        fwd = kernels(lambda x, s: rms_norm(x, s), x, scale)
        both = kernels(jax.value_and_grad(loss(lambda x, s: rms_norm(x, s)), (0, 1)), x, scale)
        assert fwd.count(TRITON) == 1 and both.count(TRITON) == 2


def test_swiglu(cc):
    from pallas_fused.swiglu import swiglu

    for shape in ((100, 5504), (3, 77), (2, 4, 2048)):
        gate, up = rnd(0, shape, jnp.bfloat16), rnd(1, shape, jnp.bfloat16)
        fwd = kernels(lambda g, u: swiglu(g, u), gate, up)
        both = kernels(jax.value_and_grad(loss(lambda g, u: swiglu(g, u)), (0, 1)), gate, up)
        assert fwd.count(TRITON) == 1 and both.count(TRITON) == 2, (shape, fwd, both)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_linear_cross_entropy(cc, layout):
    from pallas_fused.loss import linear_cross_entropy

    d, vocab = 96, 1000
    labels = jnp.arange(300, dtype=jnp.int32).reshape(3, 100) * 7 % vocab

    def fn(h, w):
        return linear_cross_entropy(h, w, labels, z_loss=1e-4, label_smoothing=0.1, logit_soft_cap=30.0)

    for dtype in (jnp.bfloat16, jnp.float32):
        hidden = rnd(0, (3, 100, d), dtype)
        weight = rnd(1, (vocab, d) if layout == "vd" else (d, vocab), dtype)
        fwd = kernels(fn, hidden, weight)
        both = kernels(jax.value_and_grad(fn, (0, 1)), hidden, weight)
        assert fwd.count(TRITON) == 1 and both.count(TRITON) == 2, (fwd, both)


@pytest.mark.parametrize("state_bits", [None, 8])
def test_adamw(cc, state_bits):
    from pallas_fused.optim import adamw, adamw_step

    params = {"w": rnd(0, (300, 520)), "b": rnd(1, (520,))}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    tx = adamw(1e-3, weight_decay=0.1, state_bits=state_bits, implementation="pallas")
    state = tx.init(params)
    step = lambda p, g, s: adamw_step(p, g, s, learning_rate=1e-3, weight_decay=0.1, implementation="pallas")
    assert kernels(step, params, grads, state).count(TRITON) >= 2

    def update(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    assert kernels(update, params, grads, state).count(TRITON) >= 2


@pytest.mark.parametrize("implementation", ["pallas", "pallas:hybrid", "pallas:xla_up"])
def test_galore(cc, implementation):
    from pallas_fused.optim import galore_adamw, galore_adamw_inplace

    params = {"w": rnd(0, (256, 384)), "v": rnd(1, (384, 200)), "b": rnd(2, (384,))}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for make in (galore_adamw, galore_adamw_inplace):
        opt = make(1e-3, rank=24, weight_decay=0.01, projector="randomized",
                   implementation=implementation)
        state = opt.init(params)
        if make is galore_adamw:
            fn = lambda p, g, s, opt=opt: optax.apply_updates(p, opt.update(g, s, p)[0])
        else:
            fn = lambda p, g, s, opt=opt: opt.step(p, g, s)
        assert kernels(fn, params, grads, state).count(TRITON) >= 3  # two projected leaves + the plain one


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_dense(cc, recipe):
    import functools

    import flax.linen as nn

    from pallas_fused.fp8 import Float8Config, Float8DotGeneral, quantize

    layer = nn.Dense(384, dtype=jnp.bfloat16, dot_general_cls=functools.partial(
        Float8DotGeneral, config=Float8Config.from_recipe(recipe)))
    x = rnd(0, (256, 512), jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(1), x)  # init would run the kernels here
    found = kernels(jax.value_and_grad(loss(lambda v, x: layer.apply(v, x)), (0, 1)), variables, x)
    mosaic = sum(found.count(t) for t in MOSAIC)
    if cc < (8, 9):  # no FP8 arithmetic before Ada: the default is XLA's (and "pallas" is refused)
        assert not any(t in found for t in (TRITON, *MOSAIC)), found
        with pytest.raises(_backend.ImplementationError, match="8.9"):
            kernels(lambda x: quantize(x, implementation="pallas"), x)
        return
    # Hopper: our GEMM takes those of one fp8 dtype. tensorwise's e4m3 x e5m2 gradient GEMMs are XLA's (wgmma reads
    # one element type), rowwise's three are ours, gw_hp's dW is a high-precision dot.
    assert mosaic == {"tensorwise": 1, "rowwise": 3, "rowwise_with_gw_hp": 2}[recipe], found
    assert found.count(TRITON) >= 2  # the quantize kernels


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_fp8_blockwise(cc, pow2):
    """The blockwise recipe on Hopper: the one-pass quantize kernels (x and dy in both layouts, W once: three calls,
    the Mosaic GPU kernel at 128-multiple shapes, else Triton's) and each of the layer's three GEMMs
    (y = x W, dx = dy W^T, dW = x^T dy) one launch of the blockwise Mosaic GPU kernel, at tile-multiple and at ragged
    shapes (padded by the api), through fp8_linear and the linen drop-in. Before Ada (no fp8) all of it is XLA's and
    "pallas" is refused."""
    import dataclasses
    import functools

    import flax.linen as nn

    from pallas_fused.fp8 import Float8Config, Float8DotGeneral, fp8_linear

    config = dataclasses.replace(Float8Config.from_recipe("blockwise"), round_scales_to_power_of_2=pow2)
    name = "pallas_fused_fp8_blockwise_matmul_sm90"
    for tokens, din, dout in ((256, 512, 384), (130, 300, 200)):
        x, w = rnd(0, (tokens, din), jnp.bfloat16), rnd(1, (din, dout), jnp.bfloat16)
        layer = loss(lambda x, w: fp8_linear(x, w, config))
        module = export.export(jax.jit(jax.value_and_grad(layer, (0, 1))), platforms=["cuda"],
                               disabled_checks=_ALLOWED)(x, w).mlir_module()
        found = re.findall(r"custom_call @([\w$.]+)", module)
        if cc < (8, 9):
            assert not any(t in found for t in (TRITON, *MOSAIC)), found
            with pytest.raises(_backend.ImplementationError, match="8.9"):
                kernels(lambda x, w: fp8_linear(x, w, config, implementation="pallas"), x, w)
            continue
        tiled = tokens % 128 == din % 128 == dout % 128 == 0
        quant = 3 if tiled else 0  # x's, dy's and W's quantize on Mosaic GPU
        assert sum(found.count(t) for t in MOSAIC) == 3 + quant and found.count(TRITON) == 3 - quant, found
        assert name in module and "pallas_fused_fp8_scaled_matmul_sm90" not in module
        backward = kernels(jax.grad(layer, 1), x, w)  # dW only: the forward GEMM is dead, dx's and W's quantize too
        assert sum(backward.count(t) for t in MOSAIC) == 1 + (2 if tiled else 0), backward
        interpret = kernels(lambda x, w: fp8_linear(x, w, config, implementation="interpret"), x, w)
        assert not any(t in interpret for t in MOSAIC), interpret  # Mosaic GPU has no interpreter: XLA's GEMMs
        dense = nn.Dense(dout, dtype=jnp.bfloat16, dot_general_cls=functools.partial(Float8DotGeneral, config=config))
        variables = jax.eval_shape(dense.init, jax.random.key(1), x)
        both = kernels(jax.value_and_grad(loss(dense.apply), (0, 1)), variables, x)
        assert sum(both.count(t) for t in MOSAIC) == 3 + quant, both


def test_fp8_quantize_blockwise_launches():
    """The blockwise quantize pass at each tuned launch: both activation copies packed (rows a multiple of 4) and
    unpacked, by chunks in a loop; one copy alone; a weight's square tiles; bf16 and fp32 x."""
    from pallas_fused.fp8 import kernel

    act, weight = (1, 128), (128, 128)
    with _backend.gpu_target((9, 0)):
        for rows, (block_n, block_t), dtype in itertools.product(
                (256, 130), ((act, act[::-1]), (act, None), (None, act[::-1]), (weight, weight)),
                (jnp.bfloat16, jnp.float32)):
            fn = functools.partial(kernel.quantize_blockwise, dtype=jnp.float8_e4m3fn, block_n=block_n,
                                   block_t=block_t)
            assert kernels(fn, rnd(0, (rows, 300), dtype)).count(TRITON) == 1, (rows, block_n, block_t)


def test_fp8_quantize_blockwise_sm90():
    """The sm90 blockwise quantize of activations and of weights (q and q^T from one read: the tile loaded as it is
    and transposed from shared memory, both fp8 tiles TMA-stored; a weight tile's amax reduced across the warps) at
    each of its launch knobs, fp32 and power-of-2 scales: Mosaic GPU's layout inference and dialect lowering run
    here."""
    from pallas_fused.fp8 import kernel_sm90_quantize as sm90

    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    configs = (sm90.QuantizeConfig(), sm90.QuantizeConfig(chunk=128, key_amax=False),
               sm90.QuantizeConfig(steps=4, stages=3, out_slots=2))
    with _backend.gpu_target((9, 0)):
        for config, pow2, dtype, square in itertools.product(configs, (False, True),
                                                             (jnp.float8_e4m3fn, jnp.float8_e5m2), (False, True)):
            fn = functools.partial(sm90.quantize_blockwise_sm90, dtype=dtype, power_of_2=pow2, config=config,
                                   square=square)
            found = kernels(fn, x)
            assert sum(found.count(t) for t in MOSAIC) == 1, (config, pow2, square, found)


def test_blockwise_gemm_promotion():
    """The blockwise GEMM's per-K-step promotion at the tiles it runs (64 x 128 split along M, the tuned one, and
    128 x 64 split along N), with the step's stage released after the promotion or early, and each scale read
    (vectors, or one scalar per warpgroup tile); Mosaic GPU's layout inference and dialect lowering run here."""
    from pallas_fused import _sm90
    from pallas_fused.fp8 import kernel_sm90

    a = jax.ShapeDtypeStruct((1024, 512), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((4, 1024), jnp.float32)
    with _backend.gpu_target((9, 0)):
        tiles = (dict(tile_m=64, tile_n=128, wg_split="m"), dict(tile_m=128, tile_n=64, wg_split="n"))
        for tile, early, rows in itertools.product(tiles, (False, True), ((1, 1), (1, 128), (128, 128))):
            config = _sm90.TileConfig(**tile, max_concurrent_steps=4, early_release=early)
            fn = functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=jnp.bfloat16, config=config,
                                   scale_rows=rows)
            found = kernels(fn, a, a, scales, scales)
            assert sum(found.count(t) for t in MOSAIC) == 1, (config, rows, found)


@pytest.mark.parametrize("cluster", ["m", "n", None])
def test_sm90_cluster(cluster):
    """The sm90 skeleton with a 2-CTA cluster (the shared operand tile one multicast TMA load) or without, at the
    FP8 GEMM's tiles (both splits), and the cluster with the per-K-step promotion and with the low-rank step (DoRA's
    16-bit GEMM), and QDoRA's GEMM (int8 a in registers) with or without it: Mosaic GPU's lowering of each runs
    here."""
    from pallas_fused import _sm90
    from pallas_fused.dora import kernel_sm90 as dora_sm90
    from pallas_fused.fp8 import kernel_sm90

    a = jax.ShapeDtypeStruct((1024, 512), jnp.float8_e4m3fn)
    vec, scales = jax.ShapeDtypeStruct((1024,), jnp.float32), jax.ShapeDtypeStruct((4, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    la, lb = jax.ShapeDtypeStruct((1024, 16), jnp.bfloat16), jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16)
    with _backend.gpu_target((9, 0)):
        calls = []
        for split in "nm":
            config = _sm90.TileConfig(wg_split=split, cluster=cluster)
            calls.append((functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config),
                          (a, a, vec, vec)))
        if cluster:
            config = _sm90.TileConfig(tile_m=64, wg_split="m", early_release=True, cluster=cluster)
            calls.append((functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=jnp.bfloat16, config=config),
                          (a, a, scales, scales)))
            config = _sm90.TileConfig(tile_k=64, max_concurrent_steps=3, cluster=cluster)
            calls.append((lambda x, w, g, la, lb, config=config: dora_sm90.scaled_matmul(x, w, g, lowrank=(la, lb),
                                                                                          config=config),
                          (x, jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16), vec, la, lb)))
        # QDoRA's GEMMs: int8 a converted in registers (wgmma's register A operand, which the interpret-mode tests
        # do not run), the low-rank step, row vectors, the result stored transposed
        config = _sm90.TileConfig(tile_m=64, tile_n=256, tile_k=64, wg_split="m", cluster=cluster)
        calls.append((lambda q, x, v, la, lb, config=config: _sm90.matmul(
            q, x, b_layout="nk", row_vecs=(v,), a_dequant=dora_sm90._int8_codes, lowrank=(la, lb),
            epilogue=dora_sm90._row_scale_bias, out_dtype=jnp.bfloat16, config=config, transpose_out=True, name="t"),
            (jax.ShapeDtypeStruct((1024, 512), jnp.int8), jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16), vec, la,
             jax.ShapeDtypeStruct((1024, 16), jnp.bfloat16))))
        for fn, args in calls:
            found = kernels(fn, *args)
            assert sum(found.count(t) for t in MOSAIC) == 1, (fn, found)


def test_sm90_pingpong():
    """The sm90 skeleton's ping-pong schedule (each compute warpgroup owning whole tiles) at the FP8 GEMM's tile,
    128 x 128 x 128, with 4 and 6 ring stages, rowwise (scale vectors) and tensorwise (scalars), bf16 and fp32 out,
    on 2-CTA clusters along M and N; and with 16-bit b read "kn" under DoRA's column epilogue: Mosaic GPU's lowering
    of each runs here."""
    from pallas_fused import _sm90
    from pallas_fused.dora import kernel_sm90 as dora_sm90
    from pallas_fused.fp8 import kernel_sm90

    a = jax.ShapeDtypeStruct((1024, 512), jnp.float8_e4m3fn)
    vec, one = jax.ShapeDtypeStruct((1024,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    with _backend.gpu_target((9, 0)):
        calls = []
        for stages, out_dtype in ((4, jnp.bfloat16), (6, jnp.bfloat16), (4, jnp.float32)):
            config = _sm90.TileConfig(max_concurrent_steps=stages, schedule="pingpong")
            fn = functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=out_dtype, config=config)
            calls += [(fn, (a, a, vec, vec)), (fn, (a, a, one, one))]
        for cluster in ("m", "n"):
            config = _sm90.TileConfig(schedule="pingpong", cluster=cluster)
            fn = functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config)
            calls.append((fn, (a, a, vec, vec)))
        config = _sm90.TileConfig(tile_k=64, schedule="pingpong")
        calls.append((lambda x, w, g, bias: _sm90.matmul(x, w, b_layout="kn", col_vecs=(g, bias),
                                                         epilogue=dora_sm90._scale_bias, out_dtype=jnp.bfloat16,
                                                         config=config, name="t"),
                      (x, jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16), vec,
                       jax.ShapeDtypeStruct((1024,), jnp.bfloat16))))
        for fn, args in calls:
            found = kernels(fn, *args)
            assert sum(found.count(t) for t in MOSAIC) == 1, (fn, found)


@pytest.mark.parametrize("implementation", ["pallas", "pallas:sm90", "pallas:merged", "pallas:epilogue", "pallas:gemm"])
def test_dora(cc, implementation):
    from pallas_fused.dora import dora_dense

    if implementation == "pallas:sm90" and cc < (9, 0):
        pytest.skip("a Hopper kernel")
    fin, fout, rank = 512, 768, 16
    x, w = rnd(0, (256, fin), jnp.bfloat16), rnd(1, (fin, fout), jnp.bfloat16)
    a, b, m = rnd(2, (fin, rank), jnp.bfloat16), rnd(3, (rank, fout), jnp.bfloat16), rnd(4, (fout,), jnp.bfloat16)
    layer = lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=2.0, implementation=implementation)
    found = kernels(jax.value_and_grad(loss(layer), (0, 1, 2, 3)), x, a, b, m)
    assert found.count(TRITON) >= 2, found
    if implementation == "pallas:sm90":
        assert sum(found.count(t) for t in MOSAIC) == 2, found  # the forward GEMM and dx, each with the low-rank step


def test_lora(cc):
    """On Hopper "pallas" runs the forward and dx as the sm90 GEMM with the low-rank step (no Triton launch) up to the
    tuned rank (12 pads to 16); elsewhere XLA."""
    from pallas_fused.dora import lora_dense

    fin, fout, rank = 512, 768, 12
    x, w = rnd(0, (256, fin), jnp.bfloat16), rnd(1, (fin, fout), jnp.bfloat16)
    a, b, bias = rnd(2, (fin, rank), jnp.bfloat16), rnd(3, (rank, fout), jnp.bfloat16), rnd(4, (fout,), jnp.bfloat16)
    layer = lambda x, a, b, bias: lora_dense(x, w, a, b, bias, scale=2.0, implementation="pallas")  # noqa: E731
    found = kernels(jax.value_and_grad(loss(layer), (0, 1, 2, 3)), x, a, b, bias)
    assert sum(found.count(t) for t in MOSAIC) == (2 if cc >= (9, 0) else 0), found


@pytest.mark.parametrize("implementation", ["pallas", "pallas:gemm"])
@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_qdora(cc, quantize, implementation):
    """Plain "pallas": on Hopper an int8 W runs the dequantising Mosaic GPU GEMMs (forward and dx) and is never formed
    in full precision; NF4, and int8 before Hopper, run "merged" (the Triton merge pass forms a transient merged
    weight for cuBLAS). "pallas:gemm": Triton GEMMs that dequantise W's tiles, W never formed."""
    from pallas_fused.dora import dora_dense, quantize_int8, quantize_nf4

    fin, fout, rank = 512, 768, 16
    w = (quantize_int8 if quantize == "int8" else quantize_nf4)(rnd(1, (fin, fout)))
    x = rnd(0, (256, fin), jnp.bfloat16)
    a, b, m = rnd(2, (fin, rank), jnp.bfloat16), rnd(3, (rank, fout), jnp.bfloat16), rnd(4, (fout,), jnp.bfloat16)
    layer = lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=2.0, implementation=implementation)  # noqa: E731
    grads = jax.value_and_grad(loss(layer), (0, 1, 2, 3))
    found = kernels(grads, x, a, b, m)
    assert found.count(TRITON) >= 2
    fused = implementation == "pallas" and cc >= (9, 0) and quantize == "int8"
    assert sum(found.count(t) for t in MOSAIC) == (2 if fused else 0), found
    # Where W is never formed in full precision, no (in, out) float array outside the branch that recomputes x W for
    # a magnitude of exactly 0 (api._dm_at_zero_magnitude, which runs only then); "merged" forms one each way.
    formed = _float_arrays(jax.make_jaxpr(grads)(x, a, b, m).jaxpr, (fin, fout))
    assert bool(formed) == (implementation == "pallas" and not fused), (quantize, formed)


def _float_arrays(jaxpr, shape) -> list[str]:
    """The primitives of `jaxpr` (nested calls included, cond branches and kernel bodies not) that produce a floating
    array of `shape` (kernels included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            continue
        for v in eqn.outvars:
            aval = v.aval
            if getattr(aval, "shape", None) == shape and jnp.issubdtype(aval.dtype, jnp.floating):
                found.append(eqn.primitive.name)
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):  # a kernel's body works on tiles and refs
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _float_arrays(inner, shape)
    return found


def test_adamw_sm90(cc):
    from pallas_fused.optim import adamw, adamw_step

    if cc < (9, 0) or _backend.JAX_VERSION < (0, 11):
        pytest.skip("the Mosaic GPU port needs a Hopper GPU and jax >= 0.11")
    params = {"w": rnd(0, (512, 1024))}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    state = adamw(1e-3).init(params)
    step = lambda p, g, s, impl="pallas:sm90": adamw_step(p, g, s, learning_rate=1e-3, weight_decay=0.1,
                                                          implementation=impl)
    found = kernels(step, params, grads, state)
    assert any(t in found for t in MOSAIC)
    with pytest.warns(DeprecationWarning, match="'pallas:sm90'"):  # its name in 0.2, for one more release
        assert kernels(functools.partial(step, impl="pallas:mosaic"), params, grads, state) == found
