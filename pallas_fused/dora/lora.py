"""Plain LoRA, fused: ``y = x W + s (x A) B + bias``, the layer DoRA is compared with.

On a Hopper GPU (16-bit x, tile-multiple shapes, a rank up to `kernel_sm90.max_rank`, DoRA's tuned one) both big
GEMMs are the sm90 kernel of dora.kernel_sm90 with its low-rank step: the forward x W + (x A)(s B) + bias and the
backward dx = dy W^T + (dy (s B)^T) A^T, each one kernel (the low-rank product in the same fp32 accumulator, no
(tokens x out) intermediate); elsewhere XLA's dots.
dA = x^T (s dy B^T) and dB = s (x A)^T dy are small XLA dots in either case. W gets no gradient (it is frozen).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_fused import _backend
from pallas_fused.dora import impls, kernel_sm90
from pallas_fused.dora.api import _check
from pallas_fused.dora.impls import pad_rank
from pallas_fused.dora.kernel_util import pow2
from pallas_fused.dora.quant import is_quantized


def lora_dense_reference(x, kernel, lora_a, lora_b, bias=None, *, scale):
    """y = x W + s (x A) B + bias in x.dtype (plain jnp; W frozen)."""
    dt = x.dtype
    w = jax.lax.stop_gradient(kernel.astype(dt))
    y = x @ w + scale * ((x @ lora_a.astype(dt)) @ lora_b.astype(dt))
    return y if bias is None else y + bias.astype(dt)


def _sm90(x, w, la, lb, bias, b_layout, config, interpret):
    return kernel_sm90.scaled_matmul(x, w, None, bias, lowrank=(la, lb), b_layout=b_layout, config=config,
                                     interpret=interpret)


def _forward(statics, x, w, a, b, bias, scale):
    tiles, interpret = statics  # tiles: the sm90 GEMMs' (kernel_sm90.LayerTiles), None for XLA's dots
    dt = x.dtype
    xa = jnp.dot(x, a)  # fp32 accumulation, rounded once to dt
    sb = (b.astype(jnp.float32) * scale).astype(dt)
    if tiles is not None:
        ap, sbp = pad_rank(a, sb)
        y = _sm90(x, w, jnp.pad(xa, ((0, 0), (0, ap.shape[1] - a.shape[1]))), sbp, bias, "kn", tiles.forward,
                  interpret)
    else:
        y = jnp.dot(x, w, preferred_element_type=jnp.float32) + jnp.dot(xa, sb, preferred_element_type=jnp.float32)
        y = (y if bias is None else y + bias.astype(jnp.float32)).astype(dt)
    return y, xa, sb


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lora_2d(statics, x, w, a, b, bias, scale):
    return _forward(statics, x, w, a, b, bias, scale)[0]


def _lora_2d_fwd(statics, x, w, a, b, bias, scale):
    y, xa, sb = _forward(statics, x, w, a, b, bias, scale)
    return y, (x, w, a, xa, sb, bias, scale)


def _lora_2d_bwd(statics, res, dy):
    tiles, interpret = statics
    x, w, a, xa, sb, bias, scale = res
    us = jnp.dot(dy, sb.T)  # s dy B^T, (tokens, rank)
    if tiles is not None:
        ap, _ = pad_rank(a, sb)
        usp = jnp.pad(us, ((0, 0), (0, ap.shape[1] - a.shape[1])))
        dx = _sm90(dy, w, usp, ap, None, "nk", tiles.dx, interpret)  # W (in, out) read as (N, K): dx (tokens, in)
    else:
        dx = (jnp.dot(dy, w.T, preferred_element_type=jnp.float32)
              + jnp.dot(us, a.T, preferred_element_type=jnp.float32)).astype(dy.dtype)
    da = jnp.dot(x.T, us)
    db = (jnp.dot(xa.T, dy, preferred_element_type=jnp.float32) * scale).astype(sb.dtype)
    dbias = None if bias is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(bias.dtype)
    return dx, jnp.zeros_like(w), da, db, dbias, jnp.zeros_like(scale)


_lora_2d.defvjp(_lora_2d_fwd, _lora_2d_bwd)


def runs_sm90(tokens: int, fin: int, fout: int, dtype, rank: int, interpret: bool) -> bool:
    """Whether `lora_dense` runs the sm90 kernels (else XLA's dots). Interpreted: wherever Mosaic GPU's interpret mode
    runs them. On a GPU: up to DoRA's tuned rank, past which the low-rank slices shrink the GEMM's SMEM ring and
    XLA's dots win (4096 tokens, 4096 -> 11008 r64 on an H200: forward+backward 1.244 ms against 1.332)."""
    args, device = impls.DoraArgs.shaped("dense", tokens, fin, fout, rank, dtype), impls.current_device()
    if interpret:
        return impls.INTERPRET["sm90"].supported(args, device) is None
    return impls.SM90.tuned(args, device)


def lora_dense(x, kernel, lora_a, lora_b, bias=None, *, scale, implementation: str | None = None):
    """LoRA dense layer: ``y = x W + s (x A) B + bias`` (W frozen: it gets a zero cotangent, as does `scale`).

    Args:
      x: input (..., in), floating point; the compute dtype (params are cast to it, as flax does).
      kernel: W (in, out), dense. lora_a: A (in, rank); lora_b: B (rank, out); bias: (out,) or None.
      scale: s, e.g. alpha / rank (a runtime operand).
      implementation: None (Pallas on a GPU, XLA elsewhere), "xla" (the plain-jnp reference), "pallas" (the
        sm90 kernels on a Hopper GPU for 16-bit x, tile-multiple shapes and a rank up to the tuned one, XLA's dots
        otherwise: at 4096 -> 11008 r64 XLA's measured faster), "interpret"
        (the sm90 kernels in Mosaic GPU's interpret mode where jax has it (>= 0.12) and the shapes fit, else XLA).
    """
    if is_quantized(kernel) or jnp.ndim(kernel) != 2 or not jnp.issubdtype(getattr(kernel, "dtype", jnp.int32),
                                                                             jnp.floating):
        raise ValueError(f"lora_dense: kernel must be a 2-D float (in, out) array (an FP8 base, an Fp8Kernel, takes "
                         f"lora_fp8_dense), got {type(kernel).__name__} of shape {getattr(kernel, 'shape', None)} "
                         f"dtype {getattr(kernel, 'dtype', None)}")
    fin, fout, rank = _check(x, kernel, lora_a, lora_b, None, bias, scale, op="lora_dense")
    impl = _backend.resolve_implementation(implementation, op="lora_dense")
    dt = x.dtype
    a, b, w = lora_a.astype(dt), lora_b.astype(dt), kernel.astype(dt)
    bias_c = None if bias is None else bias.astype(dt)
    if impl == "xla":
        return lora_dense_reference(x, w, a, b, bias_c, scale=scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, fin)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, fout), dt)
    interpret = impl == "interpret"
    tiles = None
    if runs_sm90(x2.shape[0], fin, fout, dt, rank, interpret):  # DoRA's GEMMs: its tuned tiles at this shape
        tiles = kernel_sm90.layer_tiles(x2.shape[0], fin, fout, pow2(rank), dt)
    y = _lora_2d((tiles, interpret), x2, w, a, b, bias_c, jnp.asarray(scale, jnp.float32))
    return y.reshape(*lead, fout)
