"""The LM head and its loss, forward + backward (loss, d_hidden, d_weight), bf16, vocabulary 128256 (Llama 3), at
8192 and 16384 tokens and d 2048 and 4096.

impls, timed in turn per case:
  "user:linear_cross_entropy"     the public op, default implementation (the Pallas kernels on a GPU), the weight
                                  as a Dense kernel (d, V), as HF's Flax `lm_head` holds it
  "user:linear_cross_entropy vd"  the same with a tied-embedding weight (V, d)
  "xla:chunked"                   implementation="xla": plain jnp over token chunks (never the full logits)
  "xla"                           what a JAX user writes: logits = hidden @ W in bf16, then
                                  optax.softmax_cross_entropy_with_integer_labels on them in float32, mean; jax.grad
  "probe:xla_eager"               Liger's design in jnp (`_eager_loss`): the gradients made in the forward pass over
                                  token chunks, no recomputed logits, a float32 (d, V) accumulator; not in the
                                  package, timed to show what the recompute costs on the GPU
  "peer:liger"                    Liger-Kernel's LigerFusedLinearCrossEntropyLoss in torch, same process, same values
                                  (weight (V, d), as torch's nn.Linear holds it); skipped where liger_kernel or a
                                  CUDA torch is missing

Memory, per row: jax rows report XLA's memory analysis of the compiled forward + backward: `temp_mib` (the
temporaries: what the loss needs beyond its inputs and outputs) and `peak_mib` (temporaries + outputs, the
gradients included: a (V, d) bf16 d_weight is 1002 MiB at d 4096); the torch row reports torch's
max_memory_allocated during one call less what was allocated before it (so also temporaries + outputs) as
`peak_mib`. FLOPs: the useful work, 2 N d V forward and 4 N d V backward (our implementations also recompute the
logits once in the backward: 8 N d V done). `max_abs_loss_diff` / `rel_err_dh` / `rel_err_dw`: against the "xla" row,
one call each.

--quick on a machine without a GPU runs one small case, so the script can be checked on a CPU.
`python -m benchmarks.bench_loss --table DIR_OR_JSON` prints the table of a results file (the rows of this op).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import Recorder, error_text, rnd, torch_sync
from pallas_fused import _backend
from pallas_fused.loss import linear_cross_entropy
from pallas_fused.loss.api import linear_cross_entropy_with_config
from pallas_fused.loss.kernel import LaunchConfig

OP = "loss"
VOCAB = 128256
CASES = [(8192, 2048), (8192, 4096), (16384, 2048), (16384, 4096)]
QUICK_CASES = CASES[:2]
CPU_QUICK = [(256, 64)]
CPU_VOCAB = 1000
MIB = 1 << 20
SWEEP_CASE = (8192, 4096)
# Other launches of the Pallas path, timed beside the default at SWEEP_CASE (not with --quick):
# name -> (block_tokens, block_vocab, block_k, num_warps, num_stages) for both kernels, and the backward's chunk
# (vocabulary columns; None: the default).
SWEEP = {"pallas:bv256": ((128, 256, 64, 8, 3), None), "pallas:bt64_s4": ((64, 128, 64, 4, 4), None),
         "pallas:bk32_s4": ((128, 128, 32, 8, 4), None), "pallas:chunk16384": (None, 16384)}


def _xla_loss(hidden, weight, labels):
    logits = hidden @ weight  # bf16, as a bf16 Dense lm_head gives them
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels))


def _eager_loss(chunk: int):
    """Liger's design in jnp, a probe rather than an implementation: the gradients made in the forward pass, token
    chunk by token chunk (logits, softmax - onehot, dh, dW += h^T dz, float32 dW carried), the backward only scaling
    them: 6 N d V FLOPs, no recomputed logits, at the price of a float32 (d, V) accumulator. Mean over all tokens
    (the benchmark ignores none); tokens a multiple of `chunk`."""

    @jax.custom_vjp
    def loss(hidden, weight, labels):
        return fwd(hidden, weight, labels)[0]

    def fwd(hidden, weight, labels):
        tokens, d = hidden.shape
        vocab = weight.shape[1]

        def step(dw, xs):
            h, y = xs
            z = jnp.dot(h, weight, preferred_element_type=jnp.float32)
            lse = jax.nn.logsumexp(z, axis=-1)
            total = jnp.sum(lse - jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0])
            dz = ((jnp.exp(z - lse[:, None]) - jax.nn.one_hot(y, vocab)) / tokens).astype(h.dtype)
            dh = jnp.dot(dz, weight.T, preferred_element_type=jnp.float32).astype(h.dtype)
            return dw + jnp.dot(h.T, dz, preferred_element_type=jnp.float32), (total, dh)

        dw, (totals, dhs) = jax.lax.scan(step, jnp.zeros((d, vocab), jnp.float32),
                                         (hidden.reshape(-1, chunk, d), labels.reshape(-1, chunk)))
        return jnp.sum(totals) / tokens, (dhs.reshape(tokens, d), dw.astype(weight.dtype))

    def bwd(res, g):
        dh, dw = res
        return (dh * g).astype(dh.dtype), (dw * g).astype(dw.dtype), None

    loss.defvjp(fwd, bwd)
    return loss


def _fwdbwd(loss):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _swept(labels, tokens, d, vocab, launch, chunk):
    def loss(h, w):
        cfgs = {}
        if launch is not None:
            bt, bv, bk, warps, stages = launch
            splits = max(8, _backend.cdiv(4 * _backend.num_sms(), _backend.cdiv(tokens, bt)))  # as choose_config's
            cfgs = dict(fwd_config=LaunchConfig(bt, bv, bk, warps, stages, splits=splits),
                        bwd_config=LaunchConfig(bt, bv, bk, warps, stages, group=16))
        return linear_cross_entropy_with_config(h, w, labels, implementation="pallas", chunk=chunk, **cfgs)

    return _fwdbwd(loss)


def _jax_fns(labels, tokens, d, vocab, sweep: bool):
    fns = {
        "user:linear_cross_entropy": (_fwdbwd(lambda h, w: linear_cross_entropy(h, w, labels)), "dv"),
        "user:linear_cross_entropy vd": (_fwdbwd(lambda h, w: linear_cross_entropy(h, w, labels)), "vd"),
        "xla:chunked": (_fwdbwd(lambda h, w: linear_cross_entropy(h, w, labels, implementation="xla")), "dv"),
        "xla": (_fwdbwd(lambda h, w: _xla_loss(h, w, labels)), "dv"),
        "probe:xla_eager": (_fwdbwd(lambda h, w: _eager_loss(min(tokens, 1024))(h, w, labels)), "dv"),
    }
    if sweep:
        fns.update({name: (_swept(labels, tokens, d, vocab, *spec), "dv") for name, spec in SWEEP.items()})
    return fns


def _compiled(fn, *args):
    """(the compiled fn, its memory figures): compiled once, for the timings and the memory analysis alike."""
    compiled = fn.lower(*args).compile()
    try:
        stats = compiled.memory_analysis()
        temp, out = stats.temp_size_in_bytes, stats.output_size_in_bytes
        return compiled, {"temp_mib": round(temp / MIB, 1), "peak_mib": round((temp + out) / MIB, 1)}
    except Exception as e:  # noqa: BLE001 - a backend without memory analysis still gets its timing
        return compiled, {"memory_error": error_text(e)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _liger(hidden, weight_vd, labels):
    """(fwd+bwd call, peak MiB of one call) of Liger's fused linear cross-entropy on torch copies, or None."""
    try:
        import torch
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def to_torch(x):
        try:  # on the device, no host copy
            return torch.from_dlpack(x).clone()
        except Exception:  # noqa: BLE001 - a jax/torch pair without a shared dlpack path: through the host
            dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16}.get(jnp.dtype(x.dtype))
            host = np.asarray(x.astype(jnp.float32) if dtype is not None else x)
            return torch.from_numpy(host).to("cuda", dtype or torch.from_numpy(host).dtype)

    x = to_torch(hidden).requires_grad_(True)
    w = to_torch(weight_vd).requires_grad_(True)
    y = to_torch(labels).long()
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")

    def call():
        loss = loss_fn(w, x, y)
        return loss, *torch.autograd.grad(loss, (x, w))

    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / MIB
    del out
    return call, round(peak, 1)


def run(rec: Recorder, quick: bool) -> None:
    on_gpu = _backend.gpu_device() is not None
    cases = (QUICK_CASES if quick else CASES) if on_gpu else CPU_QUICK
    vocab = VOCAB if on_gpu else CPU_VOCAB
    n, reps = 3, (3 if quick else 5)  # each call is tens of ms on a GPU; every candidate gets >= 5 rounds
    for tokens, d in cases:
        case = f"N{tokens} d{d} V{vocab} bf16 fwd+bwd"
        hidden = rnd(1, (tokens, d), jnp.bfloat16)
        weight = rnd(2, (d, vocab), jnp.bfloat16, scale=d ** -0.5)
        weight_vd = weight.T.copy()
        labels = jax.random.randint(jax.random.key(3), (tokens,), 0, vocab)
        flops = 6 * tokens * d * vocab
        fns = _jax_fns(labels, tokens, d, vocab, sweep=on_gpu and not quick and (tokens, d) == SWEEP_CASE)
        cands, ref = {}, None
        for impl, (fn, layout) in fns.items():
            args = (hidden, weight if layout == "dv" else weight_vd)
            try:
                compiled, extra = _compiled(fn, *args)
            except Exception as e:  # noqa: BLE001 - a failing implementation is a result, not a crash
                rec.add(OP, case, impl, None, error=error_text(e))
                continue
            if impl == "user:linear_cross_entropy":
                extra["implementation"] = _backend.resolve_implementation(None, op="linear_cross_entropy")
            cands[impl] = (compiled, args, extra)
        try:  # correctness beside the timings: each of ours against the materialized XLA loss, one call each
            ref = jax.device_get(cands["xla"][0](hidden, weight))
        except Exception as e:  # noqa: BLE001 - XLA's own path running out of memory is a result
            rec.add(OP, case, "xla", None, error=error_text(e))
            cands.pop("xla", None)
        for impl, (fn, args, extra) in list(cands.items()):
            if ref is None or impl == "xla":
                continue
            try:
                loss, (dh, dw) = jax.device_get(fn(*args))
            except Exception as e:  # noqa: BLE001 - a failing implementation is a result, not a crash
                rec.add(OP, case, impl, None, error=error_text(e), **extra)
                cands.pop(impl)
                continue
            extra.update(max_abs_loss_diff=float(abs(loss - ref[0])), rel_err_dh=_rel(dh, ref[1][0]),
                         rel_err_dw=_rel(dw.T if impl.endswith(" vd") else dw, ref[1][1]))
        syncs = {}
        try:
            liger = _liger(hidden, weight_vd, labels) if on_gpu else None
        except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
            liger = None
            rec.add(OP, case, "peer:liger", None, error=error_text(e))
        if liger is not None:
            cands["peer:liger"] = (liger[0], (), {"peak_mib": liger[1]})
            syncs["peer:liger"] = torch_sync
        rec.time_interleaved(OP, case, cands, n=n, reps=reps, flops=flops, syncs=syncs)
        del cands, fns


def _ratio(a, b, fmt: str = "{:.2f}") -> str:
    return fmt.format(a / b) if a and b else "-"


def table(rows: list[dict]) -> str:
    """One line per row of this op: ms, the ratios the targets are stated in (time against "xla" and Liger, memory
    against "xla"), the check against "xla"."""
    rows = [r for r in rows if r["op"] == OP]
    lines = [f"{'case':30s} {'impl':28s} {'ms':>9s} {'/xla':>6s} {'/liger':>7s} {'TFLOP/s':>8s} {'temp MiB':>9s} "
             f"{'temp/xla':>9s} {'peak MiB':>9s} {'peak/xla':>9s}  check"]
    for r in rows:
        same = {x["impl"]: x for x in rows if x["case"] == r["case"] and x.get("ms")}
        xla, liger = same.get("xla", {}), same.get("peer:liger", {})
        ex, xla_ex = r.get("extra", {}), xla.get("extra", {})
        ms = r.get("ms")
        check = ""
        if "rel_err_dw" in ex:
            check = f"dloss {ex['max_abs_loss_diff']:.1e} dh {ex['rel_err_dh']:.1e} dW {ex['rel_err_dw']:.1e}"
        if not ms:
            check = ex.get("error", "failed")[:80]
        lines.append(
            f"{r['case']:30s} {r['impl']:28s} {(f'{ms:9.3f}' if ms else '   failed')} {_ratio(ms, xla.get('ms')):>6s} "
            f"{_ratio(ms, liger.get('ms')):>7s} {(r.get('tflops') or 0):8.1f} {str(ex.get('temp_mib', '-')):>9s} "
            f"{_ratio(ex.get('temp_mib'), xla_ex.get('temp_mib'), '{:.3f}'):>9s} {str(ex.get('peak_mib', '-')):>9s} "
            f"{_ratio(ex.get('peak_mib'), xla_ex.get('peak_mib'), '{:.3f}'):>9s}  {check}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--table":
        print("usage: python -m benchmarks.bench_loss --table RESULTS_DIR_OR_JSON")
        return 2
    path = Path(argv[1])
    if path.is_dir():
        found = sorted(path.glob("*.json"))
        if not found:
            print(f"no results JSON in {path}")
            return 1
        path = found[0]
    print(table(json.loads(path.read_text())["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
