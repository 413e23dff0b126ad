"""LoRA / DoRA over an FP8 base against qwix's LoRA, the adapters-only Adam step of bench_adapt's Dense blocks (4 x
4096 -> 11008 -> 4096, 8192 tokens, r16 on a GPU; tiny on the CPU), in one process:

    lora_fp8 / dora_fp8            base_fp8="rowwise" as the library runs it (x and dy quantized by XLA)
    lora_fp8_q / dora_fp8_q        the same with x and dy quantized by `fp8.quantize`'s Pallas path instead (XLA's
                                   amax, then the Pallas cast kernel: dy diag(s) written in float32 for it), the
                                   quantization `frozen_fp8_matmul` ran before
    qwix_lora                      qwix.apply_lora_to_model on the same blocks

Each candidate is compiled, then timed in turn with qwix's step (`bench_carry_interleaved`, so each ratio has its own
qwix in the same window), and recorded at once: a run cut off keeps what it measured. Per row: ms, x qwix, XLA's
peak of the compiled step (arguments + temporaries + outputs not aliased, as bench_adapt's peak_gb) and the bytes
the forward keeps for the backward (`jax.ad_checkpoint.saved_residuals`, params and data excluded).

    OUT=/tmp/fp8_base_probe timeout -k 5 140 python -m benchmarks.probes.fp8_base_probe

Rows go to $OUT/fp8_base_probe.json as they are measured; a table is printed last (also when `timeout` ends it).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
from unittest import mock

import jax
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from benchmarks.bench_adapt import BLOCKS, RANK, candidates, make_step, model_config
from benchmarks.common import bench_carry_interleaved, error_text, probe_recorder
from pallas_fused import adapt
from pallas_fused.fp8 import frozen
from pallas_fused.fp8 import quantize as fp8_quantize

GPU = jax.default_backend() == "gpu"
DIMS = BLOCKS["1b" if GPU else "tiny"]
BATCH, SEQ = (8, 1024) if GPU else (2, 16)
OUT = os.environ.get("OUT", "/tmp/fp8_base_probe")


def pallas_quantize(x, dtype, axis, power_of_2):
    """x quantized as `frozen_fp8_matmul` did before: `fp8.quantize` with its Pallas cast kernel."""
    return fp8_quantize(x, dtype, axis, power_of_2, implementation="pallas" if GPU else "interpret")


# name: (bench_adapt's candidate, the quantization of x and dy in the FP8 GEMMs' op)
CANDIDATES = {
    "qwix_lora": ("blocks:peer:qwix_lora", None),
    "dora_fp8": ("blocks:adapt:dora_fp8", None),
    "lora_fp8": ("blocks:adapt:lora_fp8", None),
    "dora_fp8_q": ("blocks:adapt:dora_fp8", pallas_quantize),
    "lora_fp8_q": ("blocks:adapt:lora_fp8", pallas_quantize),
}


def residual_gb(loss, data, params, mask) -> float:
    """GB the forward keeps for the backward of the adapters' gradient, params and data excluded (jax's public
    listing of them is printed text: "bf16[8192,11008] output of ...")."""
    train, frozen_params = adapt.split(params, mask)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(lambda t: loss(adapt.join(t, frozen_params), data), train)
    total = 0
    for line in text.getvalue().splitlines():
        kind, dims, why = re.match(r"(\w+)\[([\d,]*)\] (.*)", line).groups()
        if not why.startswith(("from the argument", "from a constant", "from a literal")):
            digits = re.search(r"\d+", kind.replace("e4m3", "").replace("e5m2", ""))  # bf16 16, f8_e4m3fn 8
            bits = int(digits.group()) if digits else 8  # bool
            total += int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8
    return total / 1e9


def tracked(step, holder):
    """`step` that also leaves its newest state in holder[0]."""
    def run(*state):
        holder[0] = step(*state)
        return holder[0]

    return run


def build(name: str):
    """(step, state, extra) of candidate `name`, compiled."""
    source, quantize = CANDIDATES[name]
    patch = mock.patch.object(frozen, "quantize_reference", quantize) if quantize else contextlib.nullcontext()
    with patch:  # the op is traced under the patch: lowering and compiling happen here
        (_, make), = candidates(model_config("llama", "tiny"), [source], BATCH, SEQ, DIMS)
        loss, data, params, mask, context = make()
        with context():
            extra = {"residual_gb": round(residual_gb(loss, data, params, mask), 3)}
            step, state, peak = make_step(loss, data, params, mask)
    extra["peak_gb"] = round(peak, 3) if peak else None
    return step, state, extra


def table(case, device, qwix, rows) -> None:
    print(f"\n{case} on {device}")
    print(f"{'impl':12s} {'ms':>8s} {'qwix ms':>8s} {'x qwix':>7s} {'peak GB':>8s} {'resid GB':>8s}")
    if qwix is None:
        print("qwix_lora    failed or not built (see the JSON)")
    else:
        print(f"{'qwix_lora':12s} {'':8s} {'':8s} {'':7s} {qwix[2]['peak_gb'] or float('nan'):8.3f} "
              f"{qwix[2]['residual_gb']:8.3f}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['impl']:12s} failed: {r['error'][:100]}")
            continue
        print(f"{r['impl']:12s} {r['ms']:8.3f} {r.get('qwix_ms', float('nan')):8.3f} "
              f"{r.get('x_qwix', float('nan')):7.3f} {r['peak_gb'] or float('nan'):8.3f} {r['residual_gb']:8.3f}")


def main() -> None:
    # `timeout` ends the run with SIGTERM: leave through the `finally` below, so the table of what was measured prints
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    os.makedirs(OUT, exist_ok=True)
    record = probe_recorder(f"{OUT}/fp8_base_probe.json")
    case = f"dense_blocks_4x{DIMS[0]}x{DIMS[1]}_{BATCH * SEQ}tok_r{RANK}"
    device = jax.devices()[0].device_kind
    n, reps = (20, 5) if GPU else (2, 2)
    rows: list[dict] = []
    qwix = None
    try:
        try:
            qwix = build("qwix_lora")
            qwix_state = [qwix[1]]
        except Exception as e:  # noqa: BLE001 - the peer missing is a result: the FP8 rows are still timed
            record(case=case, impl="qwix_lora", ms=None, device=device, error=error_text(e))
        for name in [k for k in CANDIDATES if k != "qwix_lora"]:
            try:
                step, state, extra = build(name)
                steps = {name: (step, state)}
                if qwix is not None:  # qwix's state is donated each step: the newest is kept for the next pair
                    steps["qwix_lora"] = (tracked(qwix[0], qwix_state), qwix_state[0])
                times = bench_carry_interleaved(steps, n=n, reps=reps)
                row = dict(case=case, impl=name, ms=round(times[name], 3), device=device, **extra)
                if qwix is not None:
                    row.update(qwix_ms=round(times["qwix_lora"], 3),
                               x_qwix=round(times[name] / times["qwix_lora"], 3), qwix_peak_gb=qwix[2]["peak_gb"],
                               qwix_residual_gb=qwix[2]["residual_gb"])
                del steps, step, state
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                row = dict(case=case, impl=name, ms=None, device=device, error=error_text(e))
            record(**row)
            rows.append(row)
    finally:
        table(case, device, qwix, rows)


if __name__ == "__main__":
    main()
