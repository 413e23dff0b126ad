"""QDoRA on the Hopper GEMM ("pallas:sm90_dequant"): an Int8Kernel's codes dequantised tile by tile in registers,
forward and dx. On the CPU in Mosaic GPU's interpret mode (jax >= 0.12): forward and every gradient against the
reference with W dequantised; on a GPU (marked gpu) the compiled kernels at 4096 x 4096 r16."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_fused import _backend
from pallas_fused.dora import dora_dense, quantize_int8, quantize_nf4
from tests.dora.test_dora import check_against_reference, chosen, make

needs_interpret = pytest.mark.skipif(not _backend.has_mosaic_interpret(),
                                     reason="Mosaic GPU interpret mode needs jax >= 0.12")
IMPL = "interpret:sm90_dequant"


# (tokens, in, out, rank, bias): the smallest shapes of whole tiles (256 tokens, 128 features), both ways two K
# steps or more and two output tiles along the features; odd ranks are zero-padded to 16.
@needs_interpret
@pytest.mark.parametrize("tokens, fin, fout, rank, with_bias", [(256, 256, 512, 5, True), (256, 512, 256, 16, False)],
                         ids=["r5_bias", "r16_no_bias"])
def test_interpret_forward_and_grads(tokens, fin, fout, rank, with_bias):
    x, w, a, b, m, bias, dy = make(300, (tokens,), fin, fout, rank, jnp.bfloat16, w_dtype=jnp.float32)
    check_against_reference(quantize_int8(w), x, a, b, m, bias if with_bias else None, dy, scale=0.5, impl=IMPL,
                            what=f"sm90_dequant {tokens}x{fin}->{fout} r{rank}")


@needs_interpret
def test_interpret_zero_scale_column_and_empty():
    """A column whose int8 scale is 0 (a hand-built Int8Kernel) contributes no x W but keeps its low-rank term; zero
    tokens give an empty output."""
    from pallas_fused.dora.quant import Int8Kernel

    x, w, a, b, m, bias, dy = make(310, (256,), 256, 512, 8, jnp.bfloat16, w_dtype=jnp.float32)
    q = quantize_int8(w)
    kernel = Int8Kernel(q.q, q.scale.at[3].set(0.0))
    check_against_reference(kernel, x, a, b, m, bias, dy, scale=0.5, impl=IMPL, what="zero scale column")
    y = dora_dense(x[:0], kernel, a, b, m, bias, scale=0.5, implementation=IMPL)
    assert y.shape == (0, 512)


def test_refusals():
    """What sm90_dequant does not take is named before any kernel is built."""
    x, w, a, b, m, bias, _ = make(320, (256,), 256, 512, 8, jnp.bfloat16, w_dtype=jnp.float32)
    if _backend.has_mosaic_interpret():
        with pytest.raises(ValueError, match="multiples of its tiles"):  # 100 tokens: no whole tile
            dora_dense(x[:100], quantize_int8(w), a, b, m, bias, scale=0.5, implementation=IMPL)
        with pytest.raises(ValueError, match="needs an Int8Kernel"):
            dora_dense(x, quantize_nf4(w), a, b, m, bias, scale=0.5, implementation=IMPL)
    else:
        with pytest.raises(_backend.ImplementationError, match="jax >= 0.12"):
            dora_dense(x, quantize_int8(w), a, b, m, bias, scale=0.5, implementation=IMPL)
    if _backend.gpu_device() is None:
        with pytest.raises(_backend.ImplementationError, match="9.0"):
            dora_dense(x, quantize_int8(w), a, b, m, bias, scale=0.5, implementation="pallas:sm90_dequant")


def test_chosen():
    """Plain "pallas" takes sm90_dequant for an Int8Kernel on Hopper where the shapes fit its tiles, "merged" otherwise
    on a GPU (NF4, ragged shapes, fp32, an older GPU) and "gemm" in the interpreter."""
    with _backend.gpu_target((9, 0)):
        assert chosen("int8", 4096, 4096, 4096, jnp.bfloat16, False) == "sm90_dequant"
        assert chosen("int8", 4096, 4096, 11008, jnp.bfloat16, False, 64) == "sm90_dequant"
        assert chosen("int8", 4000, 4096, 4096, jnp.bfloat16, False) == "merged"
        assert chosen("int8", 4096 + 128, 4096, 4096, jnp.bfloat16, False) == "merged"  # tokens: 256-multiples
        assert chosen("int8", 4096, 4096, 4096, jnp.float32, False) == "merged"
        assert chosen("int8", 4096, 4096, 4096, jnp.bfloat16, True) == "gemm"
        assert chosen("nf4", 4096, 4096, 4096, jnp.bfloat16, False) == "merged"
    with _backend.gpu_target((8, 0)):
        assert chosen("int8", 4096, 4096, 4096, jnp.bfloat16, False) == "merged"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "pallas:sm90_dequant"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled(impl, with_bias):
    """The compiled kernels at 4096 tokens, 4096 -> 4096, r16, bf16: forward and all gradients."""
    if not _backend.is_hopper():
        pytest.skip("a Hopper kernel")
    x, w, a, b, m, bias, dy = make(330, (4096,), 4096, 4096, 16, jnp.bfloat16, w_dtype=jnp.float32)
    assert chosen("int8", 4096, 4096, 4096, jnp.bfloat16, False) == "sm90_dequant"
    check_against_reference(quantize_int8(w), x, a, b, m, bias if with_bias else None, dy, scale=0.5, impl=impl,
                            what=f"gpu sm90_dequant {impl}")
