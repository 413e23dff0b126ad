"""`python -m pallas_fused.tune`: tune the FP8 GEMMs of a model's shapes on this GPU into the user's tuning cache.

The default shapes are those of examples/train_llama.py's GPU preset (16 x 1024 tokens, d_model 2048, 4 key-value
heads of 128, SwiGLU 5504): each projection's forward x W, input gradient dy W^T and weight gradient x^T dy, as
(M, K, N) = tokens x in -> out, out x ... . `--tokens`, `--d-model`, `--d-kv` and `--d-ff` give another model's;
`--shapes` names the GEMMs directly. The table printed last is the choice per shape against the untuned one.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp


def model_shapes(tokens: int, d_model: int, d_kv: int, d_ff: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM of a Llama block's projections in training: per projection in -> out, the forward
    (tokens, in) x (in, out), the input gradient (tokens, out) x (out, in) and the weight gradient
    (in, tokens) x (tokens, out); each shape once."""
    projections = [(d_model, d_model), (d_model, d_kv), (d_model, d_ff), (d_ff, d_model)]  # q/o, k/v, gate/up, down
    shapes = []
    for fin, fout in projections:
        for shape in ((tokens, fin, fout), (tokens, fout, fin), (fin, tokens, fout)):
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pallas_fused.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=420.0, help="seconds of timing, compiles included (default 420)")
    p.add_argument("--cache-dir", default=None, help="where the cache file goes (default: $PALLAS_FUSED_TUNING_CACHE, "
                                                     "else ~/.cache/pallas_fused)")
    p.add_argument("--shapes", default=None, metavar="MxKxN,...", help="the GEMMs to tune (default: the model's)")
    p.add_argument("--scales", default="rowwise,tensorwise", help="rowwise and/or tensorwise (default both)")
    p.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-kv", type=int, default=512, help="key-value heads x head dim")
    p.add_argument("--d-ff", type=int, default=5504)
    p.add_argument("--no-progress", action="store_true", help="plain progress lines instead of a bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from pallas_fused import fp8
    from pallas_fused.tune import tune

    args = parse_args(argv)
    if args.shapes:
        try:
            shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
        except ValueError:
            shapes = [()]
        if any(len(s) != 3 for s in shapes):
            raise SystemExit(f"--shapes: expected MxKxN[,MxKxN...], got {args.shapes!r}")
    else:
        shapes = model_shapes(args.tokens, args.d_model, args.d_kv, args.d_ff)
    scales = args.scales.split(",")
    if not set(scales) <= {"rowwise", "tensorwise"}:
        raise SystemExit(f"--scales: expected rowwise and/or tensorwise, got {args.scales!r}")
    e4 = jnp.float8_e4m3fn
    spec = jax.ShapeDtypeStruct
    operands = [(spec((m, k), e4), spec((n, k), e4), spec((m, 1) if s == "rowwise" else (), jnp.float32),
                 spec((n, 1) if s == "rowwise" else (), jnp.float32)) for m, k, n in shapes for s in scales]

    def gemms(operands):  # what a model's FP8 projections call, at each shape
        return [fp8.scaled_matmul_nt(*ops, out_dtype=jnp.dtype(args.out_dtype)) for ops in operands]

    device = jax.devices()[0]
    print(f"tuning {len(operands)} GEMMs on {getattr(device, 'device_kind', device.platform)} (jax {jax.__version__}), "
          f"budget {args.budget:.0f} s", flush=True)
    start = time.perf_counter()
    result = tune(gemms, operands, budget_s=args.budget, cache_dir=args.cache_dir, progress=not args.no_progress)
    print(f"elapsed {time.perf_counter() - start:.1f} s", flush=True)
    print(result.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
