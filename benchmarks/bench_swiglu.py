"""SwiGLU's gating product silu(gate) * up (bf16) at the example's MLP (16 x 1024 tokens, d_ff 5504) and at d_ff
11008: forward and forward+backward.

impls: "user:swiglu" (the row of record: the public `swiglu(gate, up)` under jit, default implementation), "xla"
(`nn.silu(gate) * up` in jnp, differentiated by jax: what a JAX user writes), "peer:torch_compile" (the same in
torch, torch.compile'd; forward, and forward+backward through autograd; skipped without torch), timed in turn.
Without --quick, "pallas:<dir>_e<elements>_c<cols>_w<warps>" rows time other launch geometries of one direction's
kernel (the other direction at its default), bounded to SWEEP_SECONDS: the fastest of them is the device's
"swiglu" tuning entry (pallas_fused/tuning/<device>.json, read by kernel.choose_config).

fwd+bwd returns the forward output and both gradients (in training the output feeds the down projection). Here
dout is an input, so XLA may compute the forward inside the backward's fusion (6 arrays moved instead of 8); in a
training step dout comes from the down projection, after the forward's output was needed, so it cannot.

Bytes: the fewest the op moves: the forward reads gate and up and writes out (3 arrays); the backward reads
gate, up and dout and writes d_gate and d_up (5 more).

--quick on a machine without a GPU runs one small case, so the script can be checked on a CPU.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Recorder, error_text, rnd, torch_sync
from pallas_fused import _backend
from pallas_fused.swiglu import kernel as K
from pallas_fused.swiglu import swiglu
from pallas_fused.swiglu.api import swiglu_with_config

OP = "swiglu"
CASES = [((16384, 5504), jnp.bfloat16), ((8192, 11008), jnp.bfloat16)]
QUICK_CASES = CASES[:1]
CPU_QUICK_CASES = [((256, 5504), jnp.bfloat16)]
SWEEP_SECONDS = 60.0
# Launch geometries swept beside the default, per direction: (block_elements, max_block_cols, num_warps).
SWEEP = [(2048, 512, 4), (4096, 512, 4), (4096, 512, 8), (8192, 512, 8), (4096, 1024, 8), (8192, 1024, 8),
         (2048, 1024, 4), (1024, 512, 4)]


def _jax_fns(impl: str, fwd_config=None, bwd_config=None):
    def fwd(gate, up):
        if impl == "user":
            return swiglu(gate, up)
        if impl == "xla":
            return jax.nn.silu(gate) * up
        return swiglu_with_config(gate, up, implementation=impl, fwd_config=fwd_config, bwd_config=bwd_config)

    def fwdbwd(gate, up, dout):
        out, vjp = jax.vjp(fwd, gate, up)
        return out, vjp(dout)

    return jax.jit(fwd), jax.jit(fwdbwd)


def _torch_fns(gate, up, dout):
    """torch.compile'd forward and forward+backward of F.silu(gate) * up on copies of the inputs, or None without
    torch."""
    try:
        import torch
    except ImportError:
        return None
    import torch.nn.functional as F

    to_t = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)  # noqa: E731
    tg, tu, td = to_t(gate), to_t(up), to_t(dout)
    compiled = torch.compile(lambda g, u: F.silu(g) * u)

    def fwd():
        with torch.no_grad():
            return compiled(tg, tu)

    gr, ur = tg.detach().clone().requires_grad_(True), tu.detach().clone().requires_grad_(True)

    def fwdbwd():
        out = compiled(gr, ur)
        return out, torch.autograd.grad(out, (gr, ur), td)

    return fwd, fwdbwd


def _sweep_configs(rows: int, cols: int, backward: bool) -> dict:
    base = K.choose_config(rows, cols, backward)
    out = {}
    for elements, max_cols, warps in SWEEP:
        bc = min(1 << max(0, cols - 1).bit_length(), max_cols)
        cfg = K.LaunchConfig(max(1, elements // bc), bc, warps)
        name = f"pallas:{'bwd' if backward else 'fwd'}_e{elements}_c{max_cols}_w{warps}"
        if cfg != base and cfg not in out.values():
            out[name] = cfg
    return out


def run(rec: Recorder, quick: bool) -> None:
    cases = QUICK_CASES if quick else CASES
    if quick and _backend.gpu_device() is None:
        cases = CPU_QUICK_CASES
    deadline = time.perf_counter() + SWEEP_SECONDS
    n = 20 if quick else 50
    for shape, dtype in cases:
        gate, up, dout = rnd(1, shape, dtype, scale=2.0), rnd(2, shape, dtype), rnd(3, shape, dtype)
        size = gate.size * jnp.dtype(dtype).itemsize
        case = f"{shape[0]}x{shape[1]} {jnp.dtype(dtype).name}"
        fns = {name: _jax_fns(impl) for name, impl in (("user:swiglu", "user"), ("xla", "xla"))}
        configs = {"config_fwd": str(K.choose_config(*shape, backward=False)),
                   "config_bwd": str(K.choose_config(*shape, backward=True))}
        extra = {name: (configs if name.startswith("user") else {}) for name in fns}
        fwd_cands = {name: (f, (gate, up), extra[name]) for name, (f, _) in fns.items()}
        both_cands = {name: (fb, (gate, up, dout), extra[name]) for name, (_, fb) in fns.items()}
        syncs = {}
        try:
            peer = _torch_fns(gate, up, dout)
        except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
            peer = None
            rec.add(OP, f"{case} fwd", "peer:torch_compile", None, error=error_text(e))
        if peer is not None:
            fwd_cands["peer:torch_compile"] = (peer[0], (), {})
            both_cands["peer:torch_compile"] = (peer[1], (), {})
            syncs = {"peer:torch_compile": torch_sync}
        rec.time_interleaved(OP, f"{case} fwd", fwd_cands, n=n, nbytes=3 * size, syncs=syncs)
        rec.time_interleaved(OP, f"{case} fwd+bwd", both_cands, n=n, nbytes=8 * size, syncs=syncs)
        if quick:
            continue
        for backward in (False, True):
            for name, cfg in _sweep_configs(*shape, backward).items():
                if time.perf_counter() > deadline:
                    rec.add(OP, case, name, None, error=f"skipped: sweep time ({SWEEP_SECONDS:.0f} s) used up")
                    continue
                f, fb = _jax_fns("pallas", **{"bwd_config" if backward else "fwd_config": cfg})
                if backward:
                    rec.time(OP, f"{case} fwd+bwd", name, fb, gate, up, dout, n=n, nbytes=8 * size, config=str(cfg))
                else:
                    rec.time(OP, f"{case} fwd", name, f, gate, up, n=n, nbytes=3 * size, config=str(cfg))
