"""`apply_rotary`: the public rotary-embedding op (argument checks, implementation choice, custom_vjp)."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fused import _backend, _sharding
from pallas_fused.rotary import kernel as _kernel
from pallas_fused.rotary.reference import (
    LAYOUTS,
    RotaryScaling,
    attention_scale,
    default_positions,
    inv_frequencies,
    reference_rotary,
)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel needs besides q, k and positions (hashable: a nondiff custom_vjp argument)."""

    rotary_dim: int
    interleaved: bool
    base: float
    scaling: RotaryScaling | None
    layout: str
    interpret: bool
    config: _kernel.LaunchConfig | None = None


def _run_kernel(q, k, positions, st: _Static, inverse: bool):
    inv_freq = inv_frequencies(st.rotary_dim, st.base, st.scaling)

    def launch(q, k, positions):
        return _kernel.rotary_pallas(q, k, positions, inv_freq, rotary_dim=st.rotary_dim,
                                     interleaved=st.interleaved, layout=st.layout, scale=attention_scale(st.scaling),
                                     sign=-1.0 if inverse else 1.0, interpret=st.interpret, config=st.config)

    if jax.device_count() == 1:
        return launch(q, k, positions)
    # Sharded: each device rotates its own (batch, tokens, heads) shard; head_dim is gathered. Default
    # positions are materialised so that a shard of the sequence rotates by its global positions.
    seq_len = q.shape[1] if st.layout == "bshd" else q.shape[2]
    if positions is None:
        positions = default_positions(seq_len)
    x = "b s {} d" if st.layout == "bshd" else "b {} s d"
    terms = [x.format("h")] + ([] if k is None else [x.format("g")])
    rule = ", ".join(terms + ["s" if positions.ndim == 1 else "b s"]) + " -> " + ", ".join(terms)

    def local(*args):
        q_rot, k_rot = launch(args[0], None if k is None else args[1], args[-1])
        return q_rot if k is None else (q_rot, k_rot)

    out = _sharding.partitioned(local, rule, replicated=("d",))(*([q] if k is None else [q, k]), positions)
    return (out, None) if k is None else tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotary(q, k, positions, st: _Static):
    return _run_kernel(q, k, positions, st, inverse=False)


def _rotary_fwd(q, k, positions, st: _Static):
    # The rotation is linear in (q, k) and depends only on positions: the positions are all we keep.
    return _run_kernel(q, k, positions, st, inverse=False), positions


def _rotary_bwd(st: _Static, positions, cotangents):
    g_q, g_k = cotangents
    d_q, d_k = _run_kernel(g_q, g_k, positions, st, inverse=True)  # the transpose: rotate by -angle
    return d_q, d_k, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd)


def _check_array(name: str, x, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array (float32, bfloat16 or float16), got dtype {x.dtype}")
    if x.ndim != 4:
        dims = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
        raise ValueError(f"{name}: expected a 4-D array of shape {dims} for layout {layout!r}, got shape {x.shape}")


def apply_rotary(q, k=None, positions=None, *, rotary_dim: int | None = None, interleaved: bool = False,
                 base: float = 10000.0, scaling: RotaryScaling | None = None, layout: str = "bshd",
                 implementation: str | None = None):
    """Apply rotary position embeddings to queries and keys in one fused kernel.

    Args:
      q: queries, (B, S, Hq, D) for layout "bshd" or (B, Hq, S, D) for "bhsd"; float32, bfloat16 or float16.
      k: keys with the same B, S and D and any number of heads Hk (GQA, MQA), or None (then k_rot is None).
      positions: integer position ids, shape (S,) or (1, S) (shared by the batch) or (B, S) (packed
        sequences, KV-cache offsets, arbitrary ids); None means arange(S).
      rotary_dim: rotate the leading `rotary_dim` features (even, <= D); the rest pass through. Default D.
      interleaved: False pairs (x[i], x[i + rotary_dim/2]) (GPT-NeoX / Llama "rotate_half");
        True pairs (x[2i], x[2i+1]) (GPT-J).
      base: the frequency base ("rope_theta"); inv_freq[i] = base ** (-2i / rotary_dim). A Python number.
      scaling: None or a `RotaryScaling` (linear, llama3, yarn; each documents its formula and source).
      layout: "bshd" (tokens-major, as Flax attention) or "bhsd" (heads-major); both run without transposes.
      implementation: None (the Pallas kernel on a GPU, the XLA reference elsewhere), "pallas", "xla" or
        "interpret".

    Returns:
      (q_rot, k_rot) in the dtypes of q and k. Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin)
      times YaRN's attention factor, with angle = position * inv_freq and cos/sin computed in float32 from
      the positions (no cos/sin table is read from memory); the result is rounded once. The angle is reduced
      modulo 2 pi without rounding error (see `reference.reduced_angle`): accurate to ~1e-6 rad at every int32
      position, where an fp32 product position * inv_freq puts the output off by up to 0.17 (max abs, unit
      normal q, D=128) at position 2^20 and 3.3 at 2^24. Empty q / k (B, S or heads 0) give empty results and gradients.

    Differentiable in q and k (custom_vjp: the backward pass is the conjugate rotation, and only the
    positions are saved for it, not q or k). Works under jit, vmap and remat.
    """
    return apply_rotary_with_config(q, k, positions, rotary_dim=rotary_dim, interleaved=interleaved, base=base,
                                    scaling=scaling, layout=layout, implementation=implementation)


def apply_rotary_with_config(q, k=None, positions=None, *, rotary_dim=None, interleaved=False, base=10000.0,
                             scaling=None, layout="bshd", implementation=None,
                             config: _kernel.LaunchConfig | None = None):
    """`apply_rotary` with an explicit kernel launch geometry (for benchmarks and tests; None = heuristic)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    _check_array("q", q, layout)
    if layout == "bshd":
        batch, seq_len, _, head_dim = q.shape
    else:
        batch, _, seq_len, head_dim = q.shape
    if k is not None:
        _check_array("k", k, layout)
        k_batch, k_seq = (k.shape[0], k.shape[1]) if layout == "bshd" else (k.shape[0], k.shape[2])
        if k.shape[-1] != head_dim:
            raise ValueError(f"k: head_dim {k.shape[-1]} must equal q's head_dim {head_dim} "
                             f"(q shape {q.shape}, k shape {k.shape})")
        if (k_batch, k_seq) != (batch, seq_len):
            raise ValueError(f"k: batch and sequence sizes {(k_batch, k_seq)} must equal q's {(batch, seq_len)} "
                             f"for layout {layout!r} (q shape {q.shape}, k shape {k.shape})")
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise ValueError(f"rotary_dim: expected an int, got {rotary_dim!r}")
    rotary_dim = int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected an even number in [2, head_dim={head_dim}], got {rotary_dim}")
    if not isinstance(base, numbers.Real) or isinstance(base, bool) or not base > 1.0:  # type: ignore[operator]  # numbers.Real declares no operators
        raise ValueError(f"base: expected a Python number > 1 (static configuration), got {base!r}")
    if scaling is not None and not isinstance(scaling, RotaryScaling):
        raise ValueError(f"scaling: expected None or a RotaryScaling (e.g. RotaryScaling.linear(8.0)), "
                         f"got {type(scaling).__name__}")
    if not isinstance(interleaved, bool | np.bool_):
        raise ValueError(f"interleaved: expected a bool, got {interleaved!r}")
    if positions is not None:
        if not hasattr(positions, "dtype") or not jnp.issubdtype(positions.dtype, jnp.integer):
            got = getattr(positions, "dtype", type(positions).__name__)
            raise ValueError(f"positions: expected an integer array (int32), got {got}")
        if positions.shape not in ((seq_len,), (1, seq_len), (batch, seq_len)):
            raise ValueError(f"positions: expected shape (S,)={(seq_len,)} or (B, S)={(batch, seq_len)} "
                             f"(or (1, S)), got {positions.shape}")
        positions = jnp.asarray(positions).astype(jnp.int32)
        if positions.shape == (1, seq_len) and batch != 1:
            positions = positions[0]  # HF-style (1, S) position ids: shared by the batch

    impl = _backend.resolve_implementation(implementation, op="apply_rotary")
    if impl == "xla" or q.size == 0:
        if positions is None:
            positions = default_positions(seq_len)
        return reference_rotary(q, k, positions, rotary_dim=rotary_dim, interleaved=bool(interleaved),
                                base=float(base), scaling=scaling, layout=layout)
    st = _Static(rotary_dim, bool(interleaved), float(base), scaling, layout, impl == "interpret", config)
    return _rotary(q, k, positions, st)
