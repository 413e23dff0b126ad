"""The FP8 nt GEMM's implementation objects (pallas_fused/fp8/gemm.py) on the CPU: what each supports and why not,
its candidates and default config, plain "pallas"'s choice among them, and the interpreted Triton kernel against
the reference on random odd-shaped operands."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _sm90, _tuning
from pallas_fused.fp8 import api, gemm, kernel_sm90, quantize
from tests.helpers import rand, to64

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
S = jax.ShapeDtypeStruct
H200 = _tuning.describe("NVIDIA H200")  # compute capability 9.0, 132 SMs
H20 = _tuning.describe("NVIDIA H20")  # 9.0, 78 SMs
ADA = _tuning.Device("NVIDIA L40S", (8, 9), 142)
A100 = _tuning.describe("NVIDIA A100-SXM4-80GB")
CPU = _tuning.Device("cpu")


def spec(m, k, n, a_dtype=E4, b_dtype=E4, rowwise=(True, True), out_dtype=jnp.bfloat16, fast_accum=True):
    return gemm.GemmArgs(S((m, k), a_dtype), S((n, k), b_dtype), S((m,) if rowwise[0] else (), jnp.float32),
                         S((n,) if rowwise[1] else (), jnp.float32), out_dtype, fast_accum)


def test_names_are_the_implementation_strings():
    assert list(gemm.IMPLEMENTATIONS) == ["xla", "pallas:sm90", "pallas:triton", "interpret"]
    assert set(api.VARIANTS) < set(gemm.IMPLEMENTATIONS)
    assert gemm.CHOICES == (gemm.SM90, gemm.XLA)


@pytest.mark.parametrize("args, device, match", [
    (spec(256, 128, 256), CPU, "needs a Hopper GPU"),
    (spec(256, 128, 256), A100, r"needs a Hopper GPU .* has \(8, 0\)"),
    (spec(256, 128, 256), ADA, "needs a Hopper GPU"),
    (spec(256, 128, 256, E4, E5), H200, "needs one fp8 dtype for both operands, got float8_e4m3fn and float8_e5m2"),
    (spec(256, 128, 256, E5, E4), H20, "needs one fp8 dtype"),
    (spec(256, 128, 256, fast_accum=False), H200, "fast_accum=True"),
], ids=["cpu", "a100", "ada", "mixed", "mixed_h20", "fp32_accumulation"])
def test_sm90_refuses_with_a_reason(args, device, match):
    why = gemm.SM90.supported(args, device)
    assert isinstance(why, str)
    assert re.search(match, why), why
    assert gemm.XLA.supported(args, device) is None  # the reference runs everything
    assert gemm.INTERPRET.supported(args, device) is None  # and so does the interpreter


@pytest.mark.parametrize("a_dtype, b_dtype", [(E4, E4), (E5, E5)])
@pytest.mark.parametrize("device", [H200, H20], ids=["h200", "h20"])
def test_sm90_supports_one_dtype_with_fast_accumulation_on_hopper(a_dtype, b_dtype, device):
    for shape in ((256, 128, 256), (7, 13, 29)):  # any shape: the kernel pads
        assert gemm.SM90.supported(spec(*shape, a_dtype, b_dtype), device) is None
        assert gemm.SM90.refuses(spec(*shape, a_dtype, b_dtype)) is None
    assert gemm.SM90.refuses(spec(256, 128, 256, a_dtype, E5 if a_dtype == E4 else E4)) is not None


def test_triton_needs_fp8_arithmetic():
    args = spec(7, 13, 29, E4, E5, fast_accum=False)
    assert gemm.TRITON.supported(args, ADA) is None and gemm.TRITON.supported(args, H200) is None
    assert "compute capability 8.9" in gemm.TRITON.supported(args, A100)
    assert "compute capability 8.9" in gemm.TRITON.supported(args, CPU)


@pytest.mark.parametrize("m,k,n", [(16384, 2048, 5504), (2048, 16384, 512), (7, 13, 29), (8192, 8192, 8192),
                                   (300, 700, 500)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("device", [H200, H20], ids=["h200", "h20"])
def test_candidates_are_valid_configs(m, k, n, out_dtype, device):
    """Every implementation names at least one candidate, its default config first; sm90's are distinct tiles that
    fit one CTA's shared memory beside the result's staging, and survive the tuning tables' JSON."""
    args = spec(m, k, n, out_dtype=out_dtype)
    for impl in (gemm.XLA, gemm.TRITON, gemm.INTERPRET):
        assert list(impl.candidates(args, device).values()) == [None] == [impl.default_config(args, device)]
    found = gemm.SM90.candidates(args, device)
    assert list(found)[0] == "sm90" and found["sm90"] == gemm.SM90.default_config(args, device)
    assert len(set(found.values())) == len(found)
    for config in found.values():
        assert isinstance(config, kernel_sm90.TileConfig)
        assert _sm90.smem_bytes(config, 1, 1, jnp.dtype(out_dtype).itemsize) <= _sm90.SMEM_LIMIT
        assert gemm.SM90.from_json(gemm.SM90.to_json(config)) == config
    pingpong = [c for name, c in found.items() if name.startswith("sm90_pingpong")]
    assert all(c.schedule == "pingpong" and _sm90.supported(m, n, k, c) for c in pingpong)


@pytest.mark.parametrize("m,k,n", [(16384, 2048, 5504), (2048, 16384, 512), (512, 16384, 2048), (7, 13, 29)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("device", [H200, H20], ids=["h200", "h20"])
def test_default_config_is_the_rule(m, k, n, out_dtype, device):
    """sm90's default is `kernel_sm90.config_for` for the device's SM count (the fewer SMs, the sooner the small
    tile); the fp32 result's ring is no deeper than the bf16 one's."""
    args = spec(m, k, n, out_dtype=out_dtype)
    config = gemm.SM90.default_config(args, device)
    assert config == kernel_sm90.config_for(m, n, k, device.num_sms, out_dtype)
    assert config == kernel_sm90.fit_stages(kernel_sm90.tile_for(m, n, k, device.num_sms), out_dtype)
    bf16 = gemm.SM90.default_config(spec(m, k, n), device)
    assert config.max_concurrent_steps <= bf16.max_concurrent_steps
    assert dataclasses.replace(config, max_concurrent_steps=bf16.max_concurrent_steps) == bf16


@pytest.mark.parametrize("m,k,n,want", [(16384, 2048, 5504, "pallas:sm90"), (8192, 8192, 8192, "pallas:sm90"),
                                        (2048, 16384, 512, "xla"), (512, 16384, 2048, "xla")])
def test_plain_pallas_takes_the_rule_without_a_table(m, k, n, want):
    """Without a tuned entry, "pallas" runs the sm90 kernel unless `cublas_wins` (long K, few output tiles): at
    the narrow projections' weight gradients on 132 SMs; where the sm90 kernel does not run, XLA's dot."""
    args = spec(m, k, n)
    assert kernel_sm90.cublas_wins(m, n, k, H200.num_sms) is (want == "xla")
    assert gemm.default_choice(args, H200).name == want
    assert gemm.choose(args, H200) == (gemm.IMPLEMENTATIONS[want], None)
    for other in (dataclasses.replace(args, bt=S((n, k), E5)), dataclasses.replace(args, fast_accum=False)):
        assert gemm.choose(other, H200) == (gemm.XLA, None)
    assert gemm.choose(args, A100) == gemm.choose(args, CPU) == (gemm.XLA, None)


def test_a_choice_is_looked_up_only_where_there_is_one():
    """The tuning tables are asked (and the tuner records the shape) only where more than one implementation
    runs the GEMM; the tuner's candidates are those of the implementations that run it."""
    args = spec(16384, 2048, 5504)
    for device, looked_up in ((H200, [("fp8_gemm", args.key)]), (A100, [])):
        with _tuning.recording() as seen:
            gemm.choose(args, device)
        assert seen == looked_up
    with _tuning.recording() as seen:
        gemm.choose(dataclasses.replace(args, fast_accum=False), H200)
    assert seen == []
    if gemm.current_device().compute_capability is None:
        assert gemm.gemm_candidates(args.key) == {"xla": {"impl": "xla"}}


def test_forced_sm90_refuses_mixed_dtypes_by_name():
    a, bt, s = S((64, 32), E4), S((48, 32), E5), S((), jnp.float32)
    with pytest.raises(ValueError, match="implementation='pallas:sm90' needs one fp8 dtype for both operands"):
        jax.eval_shape(lambda *x: api._mm_nt(*x, jnp.bfloat16, True, "pallas:sm90"), a, bt, s, s)


@pytest.mark.parametrize("m,k,n", [(7, 13, 29), (33, 65, 17), (1, 40, 3)])
@pytest.mark.parametrize("a_dtype, b_dtype", [(E4, E4), (E5, E5), (E4, E5), (E5, E4)])
@pytest.mark.parametrize("rowwise", [(True, True), (False, False), (True, False)],
                         ids=["rowwise", "tensorwise", "mixed"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_interpret_matches_the_reference(m, k, n, a_dtype, b_dtype, rowwise, out_dtype):
    """The interpreted Triton kernel against the exact product of the dequantized operands (float64), within the
    output dtype's rounding (fp32 accumulation of exactly representable products), and against the XLA object."""
    a8, sa = quantize(rand(m * 7 + k, (m, k)), a_dtype, -1 if rowwise[0] else None, implementation="xla")
    bt8, sb = quantize(rand(n * 5 + k, (n, k), offset=0.25), b_dtype, -1 if rowwise[1] else None,
                       implementation="xla")
    sa, sb = sa.reshape(-1) if rowwise[0] else sa, sb.reshape(-1) if rowwise[1] else sb
    for fast_accum in (True, False):
        args = gemm.GemmArgs(a8, bt8, sa, sb, out_dtype, fast_accum)
        out = gemm.INTERPRET(args, gemm.INTERPRET.default_config(args, CPU))
        assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
        exact = (to64(a8) * to64(sa).reshape(-1, 1)) @ (to64(bt8) * to64(sb).reshape(-1, 1)).T
        tol = 2.0 ** -7 if out_dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(to64(out), exact, rtol=tol, atol=tol * np.abs(exact).max())
        np.testing.assert_allclose(to64(out), to64(gemm.XLA(args, None)), rtol=tol, atol=tol * np.abs(exact).max())
