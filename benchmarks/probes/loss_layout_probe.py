"""The fused linear cross-entropy's two weight layouts, phase by phase (development probe).

    timeout 150 python -m benchmarks.probes.loss_layout_probe [OUT_DIR] [--budget SECONDS]

At 8192 tokens, vocabulary 128256, bf16, d 4096 then d 2048, `linear_cross_entropy` with its head weight as a
(V, d) table ("vd") and as the (d, V) Dense kernel ("dv", HF's `lm_head`), timed in turn (interleaved, same
process) for each phase:

  fwd+bwd            `linear_cross_entropy` (the Pallas path), value and both gradients; its check column compares
                     the two layouts' loss and gradients
  fwd                its value alone
  fwd kernel         `logit_stats_pallas` alone (the online logsumexp over the whole vocabulary)
  dlogits            `logits_grad_pallas` alone over the backward's full chunks (the narrower last chunk left
                     out, so that every backward phase covers the same columns)
  dlogits unaligned  the same chunks shifted one column right (start = 1 + chunk * width): Triton can then prove
                     no alignment of a (d, V) tile's addresses, the load pattern the kernel had while its chunk
                     start was data of unknown alignment; a (V, d) weight should not care
  gemms              the backward's two gradient GEMMs over the same chunks with a fixed du, as the api runs them
                     (`api.chunk_gemms`: the weight's chunk as it lies, dh accumulated in float32, each dW chunk
                     written into the gradient in place)
  dh gemm / dW gemm  each of the two alone (XLA drops the other)

Rows go to OUT_DIR/loss_layout_probe.json (OUT_DIR: the argument, else $OUT, else the current folder) as they are
measured; a short table (ms per layout and dv / vd) is printed last. Phases are skipped once `--budget` seconds
(default 110) have passed, so the table still prints inside an outer `timeout 150`. Without a GPU it runs one
tiny case in interpret mode (a check of the script, not a measurement).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import bench_interleaved, error_text, probe_recorder, rnd
from pallas_fused import _backend
from pallas_fused.loss import api
from pallas_fused.loss import kernel as loss_kernel
from pallas_fused.loss.reference import LossConfig

TOKENS, VOCAB, DS = 8192, 128256, (4096, 2048)
CPU_TOKENS, CPU_VOCAB, CPU_DS, CPU_CHUNK = 64, 1000, (32,), 256
LAYOUTS = ("vd", "dv")


def _chunks(plan, vocab: int, offset: int) -> int:
    """The backward's full chunks that fit after `offset` (the unaligned phase needs one column of room)."""
    return (vocab - offset) // plan.width


def _dlogits_loop(plan, layout: str, vocab: int, offset: int):
    """Every full chunk's dlogits kernel, one after another; one element of each kept so none is dropped."""
    def run(hidden, weight, labels, lse, a, b, c):
        def body(i, acc):
            du = loss_kernel.logits_grad_pallas(hidden, weight, labels, lse, a, b, c, jnp.reshape(i, (1,)),
                                                width=plan.width, offset=offset, layout=layout, cap=None,
                                                interpret=plan.interpret, config=plan.bwd)
            return acc + du[0, 0].astype(jnp.float32)

        return lax.fori_loop(0, _chunks(plan, vocab, offset), body, jnp.float32(0))

    return jax.jit(run)


def _gemm_loop(plan, layout: str, vocab: int, keep: str):
    """The backward's loop of `api.chunk_gemms` over the full chunks with a fixed du: keep "both", "dh" or "dw"."""
    def run(hidden, weight, du):
        axis = 0 if layout == "vd" else 1

        def body(i, carry):
            dh, dw = carry
            dh_c, dw_c = api.chunk_gemms(hidden, weight, du, i * plan.width, layout)
            dh = dh + dh_c if keep != "dw" else dh
            dw = lax.dynamic_update_slice_in_dim(dw, dw_c, i * plan.width, axis=axis) if keep != "dh" else dw
            return dh, dw

        init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(weight.shape, weight.dtype))
        dh, dw = lax.fori_loop(0, _chunks(plan, vocab, 0), body, init)
        return {"both": (dh, dw), "dh": dh, "dw": dw}[keep]

    return jax.jit(run)


def _rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _check(fwdbwd, hidden, weights) -> str:
    """The two layouts against each other: loss difference and relative gradient differences (one call each)."""
    (lv, (hv, wv)), (ld, (hd, wd)) = (fwdbwd[layout](hidden, weights[layout]) for layout in LAYOUTS)
    return f"dloss {abs(float(lv) - float(ld)):.1e} dh {_rel(hd, hv):.1e} dW {_rel(wd.T, wv):.1e}"


def case_phases(record, tokens: int, d: int, vocab: int, impl: str, chunk: int | None) -> dict:
    """{phase: (layout -> (jitted fn, args))} of one d, and the layouts' fwd+bwd (for the check)."""
    bf = jnp.bfloat16
    hidden = rnd(1, (tokens, d), bf)
    w_dv = rnd(2, (d, vocab), bf, scale=d ** -0.5)
    weights = {"dv": w_dv, "vd": w_dv.T.copy()}
    labels = jax.random.randint(jax.random.key(3), (tokens,), 0, vocab)
    plans = {layout: api._plan(tokens, vocab, d, 2, LossConfig(layout), impl == "interpret", None, None, chunk)
             for layout in LAYOUTS}
    plan = plans["dv"]
    record(case=f"N{tokens} d{d} V{vocab}", fwd=str(plan.fwd), bwd=str(plan.bwd), width=plan.width,
           chunks=-(-vocab // plan.width))
    lse = jax.jit(lambda h, w: loss_kernel.logit_stats_pallas(
        h, w, labels, layout="dv", cap=None, smoothing=False, interpret=plan.interpret, config=plan.fwd)[0])(
        hidden, w_dv)
    a = jnp.full((tokens,), 1.0 / tokens, jnp.float32)
    coefs = (lse, a, a, jnp.zeros_like(a))
    du = rnd(4, (tokens, plan.width), bf, scale=1.0 / tokens)

    def loss(h, w):
        return api.linear_cross_entropy_with_config(h, w, labels, implementation=impl, chunk=chunk)

    def stats(layout):
        return jax.jit(lambda h, w: loss_kernel.logit_stats_pallas(
            h, w, labels, layout=layout, cap=None, smoothing=False, interpret=plans[layout].interpret,
            config=plans[layout].fwd))

    fwdbwd = {layout: jax.jit(jax.value_and_grad(loss, argnums=(0, 1))) for layout in LAYOUTS}
    kernel_args = {layout: (hidden, weights[layout], labels, *coefs) for layout in LAYOUTS}
    phases = {
        "fwd+bwd": lambda layout: (fwdbwd[layout], (hidden, weights[layout])),
        "dlogits": lambda layout: (_dlogits_loop(plans[layout], layout, vocab, 0), kernel_args[layout]),
        "dlogits unaligned": lambda layout: (_dlogits_loop(plans[layout], layout, vocab, 1), kernel_args[layout]),
        "gemms": lambda layout: (_gemm_loop(plans[layout], layout, vocab, "both"), (hidden, weights[layout], du)),
        "fwd kernel": lambda layout: (stats(layout), (hidden, weights[layout])),
        "fwd": lambda layout: (jax.jit(loss), (hidden, weights[layout])),
        "dh gemm": lambda layout: (_gemm_loop(plans[layout], layout, vocab, "dh"), (hidden, weights[layout], du)),
        "dW gemm": lambda layout: (_gemm_loop(plans[layout], layout, vocab, "dw"), (hidden, weights[layout], du)),
    }
    return {"phases": phases, "check": lambda: _check(fwdbwd, hidden, weights)}


def measure(record, cases: dict, deadline: float, n: int, reps: int) -> list[dict]:
    """Every phase for every d (phases outer: the most telling ones first, for both d, before the budget runs out),
    the two layouts interleaved."""
    rows = []
    for phase in next(iter(cases.values()))["phases"]:
        for d, case in cases.items():
            row = dict(d=d, phase=phase)
            if time.monotonic() > deadline:
                row["error"] = "skipped: past the time budget"
            else:
                try:
                    build = case["phases"][phase]
                    ms = bench_interleaved({layout: build(layout) for layout in LAYOUTS}, n=n, reps=reps)
                    row.update(vd_ms=round(ms["vd"], 3), dv_ms=round(ms["dv"], 3),
                               dv_over_vd=round(ms["dv"] / ms["vd"], 3))
                    if phase == "fwd+bwd":
                        row["check"] = case["check"]()
                except Exception as e:  # noqa: BLE001 - a failing phase is a result; the others still run
                    row["error"] = error_text(e)
            record(**row)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'d':>5s} {'phase':18s} {'vd ms':>9s} {'dv ms':>9s} {'dv/vd':>6s}  check"]
    for r in rows:
        if "vd_ms" in r:
            lines.append(f"{r['d']:5d} {r['phase']:18s} {r['vd_ms']:9.3f} {r['dv_ms']:9.3f} {r['dv_over_vd']:6.3f}  "
                         f"{r.get('check', '')}")
        else:
            lines.append(f"{r['d']:5d} {r['phase']:18s} {'-':>9s} {'-':>9s} {'-':>6s}  {r['error'][:70]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    start = time.monotonic()
    budget = 110.0
    if "--budget" in argv:
        at = argv.index("--budget")
        budget = float(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    out_dir = argv[0] if argv else os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "loss_layout_probe.json"))
    on_gpu = _backend.gpu_device() is not None
    record(device=jax.devices()[0].device_kind, jax=jax.__version__, on_gpu=on_gpu)
    tokens, vocab, ds, chunk = (TOKENS, VOCAB, DS, None) if on_gpu else (CPU_TOKENS, CPU_VOCAB, CPU_DS, CPU_CHUNK)
    impl, n, reps = ("pallas", 5, 3) if on_gpu else ("interpret", 1, 1)
    cases = {d: case_phases(record, tokens, d, vocab, impl, chunk) for d in ds}
    rows = measure(record, cases, start + budget, n, reps)
    print(f"\nN{tokens} V{vocab} bf16, {jax.devices()[0].device_kind}, jax {jax.__version__}; backward phases over "
          f"the full chunks; {time.monotonic() - start:.0f} s")
    print(table(rows))
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
