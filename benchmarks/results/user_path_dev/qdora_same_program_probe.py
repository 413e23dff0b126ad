"""Why plain "pallas" and "pallas:sm90_dequant" time apart on an Int8Kernel at rank 64 (development probe).

    python -m benchmarks.results.user_path_dev.qdora_same_program_probe OUT_DIR [TOKENSxINxOUT:R ...]

Both trace to the same jaxpr (the plain name resolves to "sm90_dequant" there), yet in bench_dora's QDoRA rows the
plain one took 5-8% longer at 4096 -> 11008 r64 in every round. Per case (default 4096x4096->11008:64) the forward
is jitted twice under each name, each copy compiled on its own; their optimized HLO is compared (the first
differing lines are printed), and the four are timed in turn (common.bench_interleaved). Rows go to
OUT_DIR/qdora_same_program_probe.json.
"""

from __future__ import annotations

import difflib

import jax

from benchmarks.bench_dora import _data
from benchmarks.common import bench_interleaved, probe_command_line
from pallas_fused.dora import dora_dense, quantize_int8

SCALE = 2.0


def main():
    record, cases = probe_command_line("qdora_same_program_probe", [(4096, 4096, 11008, 64)])
    print(jax.devices(), flush=True)
    for tokens, fin, fout, r in cases:
        case = f"{tokens}x{fin}->{fout} r{r}"
        x, w, a, b, m, _ = _data(tokens, fin, fout, r)
        qw = quantize_int8(w)
        cands, texts = {}, {}
        for impl in ("pallas", "pallas:sm90_dequant"):
            for copy in (1, 2):
                def fwd(x, qw, a, b, m, impl=impl):
                    return dora_dense(x, qw, a, b, m, scale=SCALE, implementation=impl)
                compiled = jax.jit(fwd).lower(x, qw, a, b, m).compile()
                name = f"{impl} #{copy}"
                texts[name] = compiled.as_text()
                cands[name] = (compiled, (x, qw, a, b, m))
        names = list(texts)
        for other in names[1:]:
            same = texts[other] == texts[names[0]]
            diff = [] if same else [line for line in difflib.unified_diff(
                texts[names[0]].splitlines(), texts[other].splitlines(), lineterm="", n=0)][:40]
            record(case=case, compare=f"{names[0]} vs {other}", identical_hlo=same, diff=diff)
        for name, ms in bench_interleaved(cands, n=30, reps=8).items():
            record(case=case, impl=name, ms=round(ms, 4))


if __name__ == "__main__":
    main()
