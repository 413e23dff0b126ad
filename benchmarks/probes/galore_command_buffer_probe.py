"""Backs docs/performance.md's paragraph on GaLore's refresh conditional under XLA's command buffers.

Development probe: on a GPU, XLA reads a `lax.cond`'s predicate back to the host before it launches the branch, so
the user path's step (`jit(update -> apply_updates)`, the refresh decided on the device) waits for the GPU once per
step. XLA can instead record a conditional into a CUDA graph as a conditional node, whose predicate stays on the
device (`--xla_gpu_enable_command_buffer` with CONDITIONAL among its types). This times, in whatever XLA_FLAGS the
process was started with, in turn:

    tx              the user path: the refresh conditional on the device
    tx_host_refresh the host's schedule (`refresh=False` static): no conditional at all
    contrib         optax.contrib.galore (its own refresh conditional)

then traces each (host_gap_us: wall minus GPU kernel time per step). Run it once as is and once with the flag, and
compare the two JSON files.

    python benchmarks/probes/galore_command_buffer_probe.py OUT_DIR TAG [MxN:r:dtype | layer:dtype ...]
"""

import os
import sys

import jax.numpy as jnp

from benchmarks.bench_galore import LLAMA7B_LAYER, _user_path_txs, probe_case, probe_step, user_path_step
from benchmarks.common import probe_recorder
from benchmarks.trace import time_then_trace

IMPLS = {"tx": "pallas:tx", "tx_host_refresh": "pallas:tx_host_refresh", "contrib": "peer:optax_contrib_galore"}


def _case(spec):
    """(row name, {param: shape}, r, dtype) of "MxN:r:dtype" (one matrix) or "layer:dtype" (a Llama-7B layer, r128)."""
    if spec.startswith("layer:"):
        dtype = jnp.dtype(spec.partition(":")[2])
        return f"llama7b layer r128 {dtype.name}", dict(LLAMA7B_LAYER), 128, dtype
    case, shape, r, dtype = probe_case(spec)
    return case, {"w": shape}, r, dtype


def main():
    out, tag = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(f"{out}/galore_command_buffer_{tag}.json")
    flags = os.environ.get("XLA_FLAGS", "")
    cases = sys.argv[3:] or ["4096x4096:128:bfloat16", "4096x4096:128:float32", "layer:bfloat16"]
    for spec in cases:
        case, shapes, r, dtype = _case(spec)

        def build(name, r=r, shapes=shapes, dtype=dtype):
            if len(shapes) == 1:
                return probe_step(name, r, shapes["w"], dtype, impl=IMPLS[name])
            return user_path_step(IMPLS[name], dict(_user_path_txs(r))[IMPLS[name]], shapes, dtype)

        time_then_trace(build, list(IMPLS), record, ref="contrib", case=case, tag=tag, xla_flags=flags)


if __name__ == "__main__":
    main()
