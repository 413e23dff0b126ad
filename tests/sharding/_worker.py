"""Sharded-op checks on 8 simulated CPU devices: `python -m tests.sharding._worker <case>`.

Run in a subprocess by test_sharding.py (XLA_FLAGS must be set before jax initialises). Each case
compares the sharded result with the single-device one, checks the output sharding, and checks that no
collective in the compiled HLO moves as many elements as a sharded operand (nothing is gathered).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH = None


def mesh():
    global MESH
    if MESH is None:
        MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    return MESH


def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh(), P(*spec)))


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def check(fn, args, expect_specs, *, tol=0.0, what=""):
    """fn under jit on sharded args == fn on unsharded args; output specs; no all-gather in the HLO."""
    plain = [jax.device_put(np.asarray(a), jax.devices()[0]) if hasattr(a, "shape") else a for a in args]
    ref = jax.jit(fn)(*plain)
    jitted = jax.jit(fn)
    out = jitted(*args)
    outs, refs = jax.tree.leaves(out), jax.tree.leaves(ref)
    assert len(outs) == len(refs) == len(expect_specs), (what, len(outs), len(refs), len(expect_specs))
    for o, r, spec in zip(outs, refs, expect_specs):
        a, b = np.asarray(o, np.float32), np.asarray(r, np.float32)
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        assert err <= tol * max(1.0, float(np.max(np.abs(b)))), f"{what}: sharded result differs by {err}"
        got = tuple(o.sharding.spec) + (None,) * (o.ndim - len(o.sharding.spec))
        want = tuple(spec) + (None,) * (o.ndim - len(spec))
        assert got == want, f"{what}: output sharding {got}, expected {want}"
    hlo = jitted.lower(*args).compile().as_text()
    # No collective may move a sharded operand's worth of data (XLA:CPU replicates a sharded operand with
    # an all-reduce of a zero-padded buffer rather than an all-gather, so every collective kind and every
    # element of a combined (tuple) collective counts;
    # the small all-reduces of per-shard partial sums stay under the bound).
    sharded = [a.size for a in args if isinstance(getattr(a, "sharding", None), NamedSharding)
               and any(tuple(a.sharding.spec))]
    bound = min(sharded)
    for line in hlo.splitlines():
        op = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(",
                       line)
        if op:
            size = max(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                       for dims in re.findall(r"\w+\[([\d,]*)\]", op.group(1)))
            assert size < bound, f"{what}: a collective moves {size} elements (sharded operands: {sharded}):\n{line}"
            # In interpret mode a kernel is plain HLO that XLA could partition itself, gathering inside the
            # kernel's loop (on a GPU the opaque kernel would get the gathered operands): none of that either.
            assert "pallas_fused_" not in line, f"{what}: a collective inside the kernel:\n{line}"
    return hlo


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------------- core


@case
def core():
    """`partitioned` on a toy kernel: summed factors (+ partial_fn), vmap, eager, shard_map, Explicit mesh."""
    from jax.experimental import pallas as pl

    from pallas_fused._sharding import partitioned

    def scale_and_colsum(x, s, out_dtype):  # (x * s, column sums of x): a pallas_call in interpret mode
        def kernel(x_ref, s_ref, o_ref, c_ref):
            o_ref[...] = (x_ref[...] * s_ref[0]).astype(o_ref.dtype)
            c_ref[...] = jnp.sum(x_ref[...].astype(jnp.float32), axis=0).astype(c_ref.dtype)

        return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                 jax.ShapeDtypeStruct(x.shape[1:], out_dtype)),
                              interpret=True)(x, s.reshape(1))

    scaled = partitioned(lambda x, s: scale_and_colsum(x, s, x.dtype)[0], "b d, -> b d")
    colsum = partitioned(lambda x, s: scale_and_colsum(x, s, x.dtype)[1], "b d, -> d", summed=("b",),
                         partial_fn=lambda x, s: scale_and_colsum(x, s, jnp.float32)[1])
    x, s = rand(20, (16, 8), jnp.bfloat16), jnp.float32(2.0)
    want = (x * 2, jnp.sum(x.astype(jnp.float32), axis=0).astype(jnp.bfloat16))

    def f(x, s):
        return scaled(x, s), colsum(x, s)

    check(f, (put(x, "data", "model"), s), [P("data", "model"), P("model")], tol=1e-2, what="core jit")
    np.testing.assert_allclose(np.asarray(f(x, s)[1], np.float32), np.asarray(want[1], np.float32), rtol=1e-2)
    xs = rand(21, (3, 16, 8))
    check(jax.vmap(f, in_axes=(0, None)), (put(xs, None, "data", "model"), s),
          [P(None, "data", "model"), P(None, "model")], tol=1e-5, what="core vmap")
    np.testing.assert_allclose(jax.vmap(jax.vmap(lambda x: f(x, s)[1]))(xs[None]), jnp.sum(xs, axis=1)[None],
                               rtol=1e-5)
    np.testing.assert_allclose(f(xs[0], s)[1], jnp.sum(xs[0], axis=0), rtol=1e-5)  # eager, one device
    sm = jax.shard_map(lambda x: f(x, s)[0], mesh=mesh(), in_specs=P("data"), out_specs=P("data"), check_vma=False)
    np.testing.assert_allclose(jax.jit(sm)(put(xs[0], "data")), xs[0] * 2)
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        out, col = jax.jit(f)(jax.device_put(xs[0], P("data", "model")), s)
        assert tuple(col.sharding.spec) == ("model",), col.sharding
    np.testing.assert_allclose(col, jnp.sum(xs[0], axis=0), rtol=1e-5)
    np.testing.assert_allclose(out, xs[0] * 2)


# ---------------------------------------------------------------------------------------------- rotary


@case
def rotary():
    from pallas_fused.rotary import apply_rotary

    q, k = rand(0, (4, 8, 4, 16)), rand(1, (4, 8, 2, 16), jnp.bfloat16)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 8)), jnp.int32)

    def f(q, k, pos):
        return apply_rotary(q, k, pos, implementation="interpret")

    # batch on data, heads on model (q and k), positions with the batch
    check(f, (put(q, "data", None, "model"), put(k, "data", None, "model"), put(pos, "data")),
          [P("data", None, "model"), P("data", None, "model")], tol=1e-6, what="rotary batch x heads")
    # sequence on data, default positions (must be the global ones), no k
    check(lambda q: apply_rotary(q, implementation="interpret")[0], (put(q, None, "data", "model"),),
          [P(None, "data", "model")], tol=1e-6, what="rotary sequence, default positions")
    # heads-major layout, partial rotary_dim
    qh = jnp.swapaxes(q, 1, 2)
    check(lambda q: apply_rotary(q, rotary_dim=8, layout="bhsd", implementation="interpret")[0],
          (put(qh, "data", "model"),), [P("data", "model")], tol=1e-6, what="rotary bhsd")


@case
def rotary_grad_vmap():
    from pallas_fused.rotary import apply_rotary

    q, k = rand(2, (4, 8, 4, 16)), rand(3, (4, 8, 2, 16))
    w = rand(4, (4, 8, 4, 16))

    def loss(q, k):
        q_rot, k_rot = apply_rotary(q, k, implementation="interpret")
        return jnp.sum(q_rot * w) + jnp.sum(k_rot * k_rot)

    check(jax.grad(loss, argnums=(0, 1)), (put(q, "data", "model"), put(k, "data", "model")),
                [P("data", "model"), P("data", "model")], tol=1e-5, what="rotary grad (backward kernel)")
    # vmap over a leading axis of a sharded stack still works (and keeps the stack axis sharded)
    qs = rand(5, (2, 4, 8, 4, 16))
    check(jax.vmap(lambda q: apply_rotary(q, implementation="interpret")[0]), (put(qs, "model", "data"),),
          [P("model", "data")], tol=1e-6, what="rotary under vmap")
    # inside shard_map (all axes manual: the kernel runs as is) and on an Explicit mesh (shard_map by the rule)
    f = jax.shard_map(lambda q: apply_rotary(q, implementation="interpret")[0], mesh=mesh(),
                      in_specs=P("data", None, "model"), out_specs=P("data", None, "model"), check_vma=False)
    ref = apply_rotary(q, implementation="interpret")[0]
    np.testing.assert_allclose(jax.jit(f)(put(q, "data", None, "model")), ref, rtol=1e-6, atol=1e-6)
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        qe = jax.device_put(q, P("data", None, "model"))
        out = jax.jit(lambda q: apply_rotary(q, implementation="interpret")[0])(qe)
        assert tuple(out.sharding.spec)[:3] == ("data", None, "model"), out.sharding
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- fp8


@case
def fp8():
    from pallas_fused.fp8 import api as fp8

    x = rand(6, (16, 32))
    quant = jax.jit(lambda x, axis: fp8.quantize(x, axis=axis, implementation="interpret"), static_argnums=1)
    check(lambda x: quant(x, -1), (put(x, "data"),), [P("data"), P("data")], what="quantize rowwise")
    check(lambda x: quant(x, 0), (put(x, None, "model"),), [P(None, "model"), P(None, "model")],
          what="quantize columnwise")
    # the reduced axis split: per-shard amax + pmax, the cast on each shard (tensorwise: every axis reduced)
    check(lambda x: quant(x, -1), (put(x, "data", "model"),), [P("data", "model"), P("data")],
          what="quantize rowwise, reduced axis split")
    check(lambda x: quant(x, None), (put(x, "data", "model"),), [P("data", "model"), P()],
          what="quantize tensorwise")
    a, sa = fp8.quantize(x, axis=-1, implementation="xla")
    bt, sb = fp8.quantize(rand(7, (8, 32)), axis=-1, implementation="xla")

    def mm(a, bt, sa, sb):
        return fp8.scaled_matmul_nt(a, bt, sa, sb, out_dtype=jnp.float32, implementation="interpret")

    check(mm, (put(a, "data"), put(bt, "model"), put(sa, "data"), put(sb, "model")), [P("data", "model")],
          tol=1e-6, what="scaled_matmul_nt M x N")
    # fp8_linear forward, rowwise: tokens on data, output features on model
    w = rand(8, (32, 8))
    check(lambda x, w: fp8.fp8_linear(x, w, "rowwise", implementation="interpret"),
          (put(x, "data"), put(w, None, "model")), [P("data", "model")], tol=1e-6, what="fp8_linear rowwise")

    # fp8_linear gradients, data parallel: the weight-gradient GEMM contracts the sharded tokens (float32
    # partial products + all-reduce of dW), the input-gradient GEMM keeps tokens on data
    for recipe in ("rowwise", "tensorwise"):
        def loss(x, w, recipe=recipe):
            return jnp.sum(fp8.fp8_linear(x, w, recipe, implementation="interpret").astype(jnp.float32) ** 2)

        check(jax.grad(loss, argnums=(0, 1)), (put(x, "data"), put(w)), [P("data"), P()], tol=1e-5,
              what=f"fp8_linear grad, data parallel, {recipe}")
    # scaled_matmul_nt with the contraction K split (row-parallel): partial products + all-reduce
    check(mm, (put(a, None, "model"), put(bt, None, "model"), put(sa), put(sb)), [P()], tol=1e-5,
          what="scaled_matmul_nt K split")


# ---------------------------------------------------------------------------------------------- dora


@case
def dora():
    from pallas_fused.dora import Int8Kernel, column_scale, dora_dense, quantize_int8

    x, w = rand(9, (32, 32)), rand(10, (32, 16))  # x larger than any weight: a gathered x stands out
    a, b, m, bias = rand(11, (32, 4)), rand(12, (4, 16)), 1.0 + jnp.abs(rand(13, (16,))), rand(14, (16,))

    def f(x, w, a, b, m, bias):
        return dora_dense(x, w, a, b, m, bias, scale=0.5, implementation="interpret")

    # tokens on data, output features on model (W, B, magnitude, bias split by column)
    sharded = (put(x, "data"), put(w, None, "model"), put(a), put(b, None, "model"), put(m, "model"),
               put(bias, "model"))
    check(f, sharded, [P("data", "model")], tol=1e-5, what="dora_dense forward")

    def loss(x, w, a, b, m, bias):  # the "gemm" variant: the backward dx kernel too
        return jnp.sum(dora_dense(x, w, a, b, m, bias, scale=0.5, implementation="interpret:gemm") ** 2)

    # backward (dx and column kernels): tokens on data; the column kernel sums tokens per shard + psum
    check(jax.grad(loss, argnums=(0, 2, 3, 4, 5)), (put(x, "data"), put(w), put(a), put(b), put(m), put(bias)),
          [P("data"), P(), P(), P(), P()], tol=1e-4, what="dora_dense grad, data parallel")
    # column norm with W split along both axes (FSDP-like rows): per-shard sums of squares + psum
    check(lambda w, a, b, m: column_scale(w, a, b, m, scale=0.5, implementation="interpret"),
          (put(w, "data", "model"), put(a, "data"), put(b, None, "model"), put(m, "model")), [P("model")],
          tol=1e-5, what="column_scale, W split along in and out")
    # int8 kernel: forward, tokens x output features
    wq = quantize_int8(w)
    check(lambda x, q, s, a, b, m: dora_dense(x, Int8Kernel(q, s), a, b, m, scale=0.5, implementation="interpret"),
          (put(x, "data"), put(wq.q, None, "model"), put(wq.scale, "model"), put(a), put(b, None, "model"),
           put(m, "model")), [P("data", "model")], tol=1e-5, what="dora_dense int8 forward")

    def loss_q(x, q, s, a, b, m):  # int8 + plain "interpret": the "gemm" variant's dx kernel, tokens on data
        return jnp.sum(dora_dense(x, Int8Kernel(q, s), a, b, m, scale=0.5, implementation="interpret") ** 2)

    check(jax.grad(loss_q, argnums=(0, 3, 4, 5)), (put(x, "data"), put(wq.q), put(wq.scale), put(a), put(b), put(m)),
          [P("data"), P(), P(), P()], tol=1e-4, what="dora_dense int8 grad, data parallel")


# ---------------------------------------------------------------------------------------------- embed, norm


@case
def embed_norm():
    from pallas_fused.embed import embed
    from pallas_fused.norm import rms_norm

    table, w = rand(0, (12, 8)), rand(1, (8, 40, 8))
    ids = jax.random.randint(jax.random.key(2), (8, 40), -12, 12)

    def embed_loss(t, ids):  # the one-hot gradient kernel per token shard, the (V, D) partials all-reduced
        return jnp.sum(embed(t, ids, implementation="interpret") * w)

    check(jax.grad(embed_loss), (put(table), put(ids, "data", "model")), [P()], tol=1e-5,
          what="embed grad, tokens sharded")
    x, scale, dy = rand(3, (8, 6, 24)), rand(4, (24,)) + 1.0, rand(5, (8, 6, 24))

    def norm_loss(x, s):  # rows sharded, features whole; dscale partials all-reduced
        return jnp.sum(rms_norm(x, s, implementation="interpret") * dy)

    check(jax.grad(norm_loss, argnums=(0, 1)), (put(x, "data"), put(scale)), [P("data"), P()],
          tol=1e-5, what="rms_norm grad, rows sharded")
    check(lambda x: rms_norm(x, implementation="interpret"), (put(x, "data"),), [P("data")], tol=1e-6,
          what="rms_norm forward, no scale")


@case
def swiglu():
    from pallas_fused.swiglu import swiglu

    gate, up, dout = rand(6, (8, 8, 24), jnp.bfloat16), rand(7, (8, 8, 24), jnp.bfloat16), rand(8, (8, 8, 24))

    def loss(g, u):  # elementwise: every axis stays split, features included
        return jnp.sum(swiglu(g, u, implementation="interpret").astype(jnp.float32) * dout)

    spec = ("data", None, "model")
    check(lambda g, u: swiglu(g, u, implementation="interpret"), (put(gate, *spec), put(up, *spec)), [P(*spec)],
          what="swiglu forward, rows and features sharded")
    check(jax.grad(loss, argnums=(0, 1)), (put(gate, *spec), put(up, *spec)), [P(*spec), P(*spec)],
          what="swiglu grad, rows and features sharded")
    check(jax.grad(loss, argnums=(0, 1)), (put(gate, None, "data"), put(up, None, "data")),
          [P(None, "data"), P(None, "data")], what="swiglu grad, sequence sharded")


def run_in_subprocess(module: str, names) -> None:
    """Run cases `names` of worker `module` in one fresh process with 8 simulated CPU devices (the flag must be
    set before jax starts its CPU backend, hence the subprocess; one process for all cases pays for jax's
    start and the compiles the cases share once). Every case runs even after one fails; the failures are named."""
    from tests.helpers import SUBPROCESS_XLA_FLAGS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{SUBPROCESS_XLA_FLAGS} --xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", module, *names], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    failed = [name for name in names if f"ok {name}" not in proc.stdout.splitlines()]
    assert proc.returncode == 0 and not failed, f"failed: {failed}\n" + proc.stdout + proc.stderr[-8000:]


def main(cases: dict) -> None:
    # Read when the CPU backend starts (first use of jax below), not at import.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    assert jax.device_count() == 8, jax.devices()
    failed = []
    for name in sys.argv[1:]:
        try:
            cases[name]()
        except Exception:  # reported with its traceback; the other cases still run
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            failed.append(name)
        else:
            print(f"ok {name}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(CASES)
