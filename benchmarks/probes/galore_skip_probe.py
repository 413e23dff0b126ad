"""Backs docs/performance.md's 'the check before the moments, or in two stages, gave XLA's same fusions'.

Development probe: the structure of the non-finite skip in GaLore's XLA-graph optax step, on the host's refresh
schedule (no conditional: the step's time is the GPU's and its launches'). Two formulations of the same skip:

    after    the new moments, then one reduction over them (XLA fuses the moments into the reduction as side
             outputs), then a select per output between the new and the old
    before   the package's: the reduction first (reference.lowrank_finite, over the new moments computed and
             dropped), then one elementwise pass computing the moments with the selects inside
             (reference.lowrank_adam with s.ok)
    staged   "after", its reduction split over the rank axis first, then the rest (staged_barrier: with an
             optimization barrier between the two)

timed in turn in a fresh process beside optax.contrib.galore, then traced.

    python benchmarks/probes/galore_skip_probe.py OUT_DIR [MxN:r:dtype ...]
"""

import os
import sys

import jax.numpy as jnp
from jax import lax

from benchmarks.bench_galore import probe_case, probe_step
from benchmarks.common import probe_recorder
from benchmarks.trace import time_then_trace
from pallas_fused.galore import api, reference

F32 = jnp.float32
BEFORE = api._GaLore._leaf


def _leaf_after(self, w, g, m, v, p, side, s, inplace, dtype):
    m_new, v_new, n = reference.lowrank_adam(reference.project(g, p, side), m, v, s)
    keep = jnp.all(jnp.isfinite(m_new) & jnp.isfinite(v_new)) & (s.ok > 0)
    m_new, v_new = jnp.where(keep, m_new, m), jnp.where(keep, v_new, v)
    s = s._replace(ok=keep.astype(F32))
    return reference.finish_step(w, n, p, side, s, inplace=inplace, dtype=dtype), m_new, v_new


def _leaf_staged(barrier):
    """The package's skip with its reduction in two stages: over the rank axis first (a row or column reduction
    with the moments as side outputs), then over what is left; `barrier` keeps XLA from folding the two back into
    one reduction."""
    def leaf(self, w, g, m, v, p, side, s, inplace, dtype):
        m_new, v_new, n = reference.lowrank_adam(reference.project(g, p, side), m, v, s)
        ok = jnp.isfinite(m_new) & jnp.isfinite(v_new)
        part = jnp.all(ok, axis=1 if side == "right" else 0)
        if barrier:
            part = lax.optimization_barrier(part)
        keep = jnp.all(part) & (s.ok > 0)
        m_new, v_new = jnp.where(keep, m_new, m), jnp.where(keep, v_new, v)
        s = s._replace(ok=keep.astype(F32))
        return reference.finish_step(w, n, p, side, s, inplace=inplace, dtype=dtype), m_new, v_new
    return leaf


LEAVES = {"after": _leaf_after, "before": BEFORE, "staged": _leaf_staged(False), "staged_barrier": _leaf_staged(True)}


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(f"{out}/galore_skip_probe.json")
    cases = sys.argv[2:] or ["4096x4096:128:bfloat16", "4096x4096:128:float32", "4096x4096:32:float32",
                             "4096x11008:128:bfloat16"]
    for spec in cases:
        case, shape, r, dtype = probe_case(spec)

        def build(name, r=r, shape=shape, dtype=dtype):
            patch = None if name == "contrib" else (api._GaLore, "_leaf", LEAVES[name])
            return probe_step(name, r, shape, dtype, impl="pallas:tx_host_refresh", patch=patch)

        time_then_trace(build, [*LEAVES, "contrib"], record, ref="contrib", case=case)


if __name__ == "__main__":
    main()
