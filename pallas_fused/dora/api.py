"""Public DoRA functions: argument checks and the implementation choice (the implementations: impls.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_fused import _backend
from pallas_fused.dora import impls, reference
from pallas_fused.dora.config import DEFAULT, Config
from pallas_fused.dora.quant import Fp8Kernel, dequantize, is_quantized


def _check(x, kernel, lora_a, lora_b, magnitude, bias, scale, op="dora_dense", fp8_base=False):
    """Validate shapes/dtypes; returns (in_features, out_features, rank). magnitude=None: LoRA (none to check).
    `fp8_base`: the kernel must be an Fp8Kernel (and is refused otherwise)."""
    x_dtype = getattr(x, "dtype", None)
    if x_dtype is None or not jnp.issubdtype(x_dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a floating-point array, got dtype {x_dtype}")
    if len(x.shape) < 1:
        raise ValueError(f"{op}: x must have at least one dimension (..., in_features)")
    if isinstance(kernel, Fp8Kernel) != fp8_base:
        raise ValueError(f"{op}: kernel must be an Fp8Kernel (pallas_fused.dora.quantize_fp8), got "
                         f"{type(kernel).__name__}" if fp8_base else
                         f"{op}: kernel is an Fp8Kernel (an FP8 base): use pallas_fused.dora."
                         f"{'lora' if magnitude is None else 'dora'}_fp8_dense, whose base GEMMs run in FP8")
    if is_quantized(kernel):
        fin, fout = kernel.shape
    else:
        if jnp.ndim(kernel) != 2 or not jnp.issubdtype(kernel.dtype, jnp.floating):
            raise ValueError(f"{op}: kernel must be a 2-D float (in, out) array or an Int8Kernel/NF4Kernel, "
                             f"got shape {jnp.shape(kernel)} dtype {getattr(kernel, 'dtype', None)}")
        fin, fout = kernel.shape
    if x.shape[-1] != fin:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features but kernel expects {fin} "
                         f"(kernel shape {(fin, fout)})")
    if jnp.ndim(lora_a) != 2 or lora_a.shape[0] != fin:
        raise ValueError(f"{op}: lora_a must have shape ({fin}, rank), got {jnp.shape(lora_a)}")
    rank = lora_a.shape[1]
    if rank < 1 or rank > min(fin, fout):
        raise ValueError(f"{op}: lora_a rank must be in [1, min(in, out) = {min(fin, fout)}], got {rank}")
    if jnp.shape(lora_b) != (rank, fout):
        raise ValueError(f"{op}: lora_b must have shape ({rank}, {fout}), got {jnp.shape(lora_b)}")
    if magnitude is not None and jnp.shape(magnitude) != (fout,):
        raise ValueError(f"{op}: magnitude must have shape ({fout},), got {jnp.shape(magnitude)}")
    if bias is not None and jnp.shape(bias) != (fout,):
        raise ValueError(f"{op}: bias must have shape ({fout},) or be None, got {jnp.shape(bias)}")
    if jnp.ndim(scale) != 0:
        raise ValueError(f"{op}: scale must be a scalar, got shape {jnp.shape(scale)}")
    for name, v in (("lora_a", lora_a), ("lora_b", lora_b), ("magnitude", magnitude), ("bias", bias)):
        if v is not None and not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be floating point, got dtype {v.dtype}")
    return fin, fout, rank


def dora_dense(x, kernel, lora_a, lora_b, magnitude, bias=None, *, scale, exact_norm_grad: bool = False,
               implementation: str | None = None, save_merged: bool | None = None, config: Config | None = None):
    """DoRA dense layer: ``y = (x W + s (x A) B) * (m / ||W + s A B||) + bias``.

    Args:
      x: input (..., in), floating point; the compute dtype (params are cast to it, as flax does).
      kernel: the frozen base weight W (in, out), or a quantised `Int8Kernel` / `NF4Kernel` (QDoRA).
      lora_a: A (in, rank); lora_b: B (rank, out); magnitude: m (out,); bias: (out,) or None.
      scale: s, e.g. alpha / rank (a runtime operand: changing it does not recompile).
      exact_norm_grad: differentiate through the column norm (default: treat it as a constant, as the
        DoRA paper section 4.3 and peft do).
      implementation: None (Pallas on a GPU, XLA elsewhere), "xla", "pallas", "interpret", or one variant of the
        Pallas path, "pallas:<variant>" ("interpret:<variant>" runs it in the Pallas interpreter; see `VARIANTS`).
        Plain "pallas" takes `impls.choose`'s pick: "sm90" where that runs, else "merged" or "epilogue" for dense
        weights, whichever makes the smaller extra pass over memory at this shape; for quantised ones
        "sm90_dequant" where that runs, else "merged" ("gemm" interpreted). On Hopper a dense layer's variant and
        "sm90"'s tiles come from the tuning cache where `pallas_fused.tune` measured this shape.
        "pallas:gemm": Pallas GEMMs both ways (the fused-epilogue forward, the dx GEMM; W dequantised in-kernel, never
        formed in full precision: the least memory for an Int8Kernel / NF4Kernel off Hopper, and the slowest).
        "pallas:epilogue": cuBLAS x W, then one Pallas pass (x W + s (x A) B) * g + bias (dense W).
        "pallas:merged": one Pallas pass forms (W + s A B) * g, then one cuBLAS GEMM (x A waits for the backward).
        For a dense W the merged weight is kept for the backward's dx (one copy of W per layer in the compute dtype,
        held from the forward to the backward; `save_merged=False` forms it again in the backward instead). Also
        takes an Int8Kernel / NF4Kernel (QDoRA at cuBLAS speed): the merged weight is then a transient
        full-precision array, formed again in the backward.
        "pallas:sm90" (Hopper, dense 16-bit W, tile-multiple shapes; "interpret:sm90" on jax >= 0.12): the column
        norm's read-only pass over W, then one Mosaic GPU GEMM (x W + (x A)(s B)) g + bias (the low-rank product in
        its accumulator, g and the bias in its epilogue); the backward's dx = (dy g) W^T + ((dy g)(s B)^T) A^T is one
        such GEMM too. W + s A B is never formed; only x A (tokens x rank) is kept for the backward.
        "pallas:sm90_dequant" (Hopper, Int8Kernel, 16-bit x, tile-multiple shapes; plain "pallas" takes it there): the
        column norm read from the int8 codes in-kernel, then one Mosaic GPU GEMM (x q + (x A)(s B / wscale)) g wscale
        + bias with q's int8 tiles converted in registers and the low-rank term in the same fp32 accumulator; the
        backward's dx = (dy g wscale) q^T + ((dy g)(s B)^T) A^T likewise. W is never formed in full precision.
        "merged" and "epilogue" run dx on cuBLAS (with many tokens, or quantised weights, one GEMM on the merged
        weight).
      save_merged: "merged" only: keep the merged weight from the forward for the backward's dx (True: one copy of W
        per layer in the compute dtype held until the backward, e.g. ~12.5 GB over a Llama-7B's 32 blocks in bf16),
        or form it again in the backward (False: one more pass over W, ~0.016 ms per 4096 x 4096 layer on an H200).
        None: `config.save_merged`, whose default None keeps it for a dense W and forms it again for a quantised one.
      config: tile sizes of the Pallas kernels (advanced).

    Gradients flow to x, lora_a, lora_b, magnitude and bias; W (and `scale`) get zero cotangents.

    Precision: with float32 x on a GPU the GEMMs (Pallas and cuBLAS alike) run at TF32 by default (~4e-4 relative,
    as XLA's own fp32 matmuls); under ``jax.default_matmul_precision("highest")`` every one of them runs in full
    fp32 (~1e-6). The norm is floored at 1e-12 (`reference.NORM_FLOOR`), so a column of W + s A B that is all
    zero gives g = 0 and an output column equal to the bias, with finite gradients (peft gets NaN there). Zero
    tokens give an empty output and zero gradients.
    """
    fin, fout, rank = _check(x, kernel, lora_a, lora_b, magnitude, bias, scale)
    impl = _backend.resolve_implementation(implementation, op="dora_dense", variants=impls.VARIANTS)
    base, variant = _backend.split_implementation(impl)
    dt = x.dtype
    a, b = lora_a.astype(dt), lora_b.astype(dt)
    bias_c = None if bias is None else bias.astype(dt)
    args = impls.DoraArgs(x, kernel, a, b, magnitude, bias_c, scale, bool(exact_norm_grad))
    if base == "xla":
        return impls.XLA(args)
    lead = x.shape[:-1]
    args = dataclasses.replace(args, x=x.reshape(-1, fin))
    if args.tokens == 0:
        return jnp.zeros((*lead, fout), dt)
    device = impls.current_device()
    if variant is None:
        chosen = impls.choose(args, device, interpret=base == "interpret")
    else:
        chosen = (impls.INTERPRET if base == "interpret" else impls.PALLAS)[variant]
        why = chosen.supported(args, device)
        if why is not None:
            raise ValueError(f"dora_dense: implementation={impl!r} {why}; got x {x.shape} {x.dtype}, a {args.kind} "
                             f"kernel {(fin, fout)}, rank {rank}")
    config = config or chosen.default_config(args, device)
    if save_merged is not None and save_merged != config.save_merged:
        config = dataclasses.replace(config, save_merged=bool(save_merged))
    return chosen(args, config).reshape(*lead, fout)


def dora_dense_dropout(x, x_dropped, kernel, lora_a, lora_b, magnitude, bias=None, *, scale,
                       exact_norm_grad: bool = False, implementation: str | None = None, **kw):
    """peft's dropout form: ``y = x W + bias + (g - 1) (x_d W) + g s (x_d A) B`` (x_d = dropout(x)).

    Computed as ``dora_dense(x_d, ...) + (x - x_d) W``: the fused layer on the dropped input plus one
    plain matmul of the dropped-out part (XLA; for quantised kernels W is dequantised for that matmul).
    """
    if jnp.shape(x_dropped) != jnp.shape(x):
        raise ValueError(f"dora_dense_dropout: x_dropped must have x's shape {jnp.shape(x)}, "
                         f"got {jnp.shape(x_dropped)}")
    y = dora_dense(x_dropped, kernel, lora_a, lora_b, magnitude, bias, scale=scale, exact_norm_grad=exact_norm_grad,
                   implementation=implementation, **kw)
    w = jax.lax.stop_gradient(dequantize(kernel, x.dtype))
    rest = jnp.dot(x - x_dropped, w, preferred_element_type=jnp.float32)
    return (y.astype(jnp.float32) + rest).astype(y.dtype)


def column_scale(kernel, lora_a, lora_b, magnitude, *, scale, implementation: str | None = None,
                 config: Config | None = None):
    """g = m / ||W + s A B|| (float32, (out,)) with the fused column-norm kernel (no A B materialised)."""
    fin, fout = kernel.shape
    x_probe = jax.ShapeDtypeStruct((1, fin), jnp.float32)
    _check(x_probe, kernel, lora_a, lora_b, magnitude, None, scale)
    impl = _backend.resolve_implementation(implementation, op="column_scale")
    dt = kernel.dtype if not is_quantized(kernel) else lora_a.dtype
    if impl == "xla":
        return reference.column_scale_reference(kernel, lora_a, lora_b, magnitude, scale, dt)
    kind, ops = impls.weight_ops(kernel, dt)
    ap, bp = impls.pad_rank(lora_a.astype(dt), lora_b.astype(dt))
    return impls.column_norm_scale(ops, kind, ap, bp, jnp.asarray(scale, jnp.float32), magnitude,
                                   impl == "interpret", config or DEFAULT)[1]
