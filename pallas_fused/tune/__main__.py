"""`python -m pallas_fused.tune`: tune the FP8 GEMMs and DoRA layers of a model's shapes on this GPU into the user's
tuning cache.

The default shapes are those of examples/train_llama.py's GPU preset (16 x 1024 tokens, d_model 2048, 4 key-value
heads of 128, SwiGLU 5504) and of its DoRA fine-tune (rank 16 on every projection, bf16). FP8 (`--ops fp8`): each
projection's forward x W, input gradient dy W^T and weight gradient x^T dy, as (M, K, N) = tokens x in -> out,
out x ... ; `--shapes` names the GEMMs directly. DoRA (`--ops dora`): each projection's layer, forward and backward,
whose tiles are tuned where it runs the sm90 kernels (a Hopper GPU, tile-multiple shapes: `dora_dense`'s plain
"pallas" choice). `--tokens`, `--d-model`, `--d-kv`, `--d-ff` and `--dora-rank` give another model's. The table
printed last is the choice per shape against the untuned one.
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


def dora_layers(d_model: int, d_kv: int, d_ff: int) -> list[tuple[int, int]]:
    """(in, out) of a Llama block's projections, each once: q/o, k/v, gate/up, down."""
    return list(dict.fromkeys([(d_model, d_model), (d_model, d_kv), (d_model, d_ff), (d_ff, d_model)]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pallas_fused.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=420.0, help="seconds of timing, compiles included (default 420)")
    p.add_argument("--cache-dir", default=None, help="where the cache file goes (default: $PALLAS_FUSED_TUNING_CACHE, "
                                                     "else ~/.cache/pallas_fused)")
    p.add_argument("--ops", default="fp8,dora", help="what to tune: fp8 (the FP8 GEMMs) and/or dora (the DoRA "
                                                     "layers' sm90 tiles); default both")
    p.add_argument("--shapes", default=None, metavar="MxKxN,...", help="the GEMMs to tune (default: the model's)")
    p.add_argument("--scales", default="rowwise,tensorwise", help="rowwise and/or tensorwise (default both)")
    p.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-kv", type=int, default=512, help="key-value heads x head dim")
    p.add_argument("--d-ff", type=int, default=5504)
    p.add_argument("--dora-rank", type=int, default=16, help="the DoRA adapters' rank (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the DoRA layers' compute "
                                                                                       "dtype (default bfloat16)")
    p.add_argument("--no-progress", action="store_true", help="plain progress lines instead of a bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from pallas_fused import dora, fp8
    from pallas_fused.tune import tune

    args = parse_args(argv)
    ops = args.ops.split(",")
    if not ops or not set(ops) <= {"fp8", "dora"}:
        raise SystemExit(f"--ops: expected fp8 and/or dora, got {args.ops!r}")
    if args.dora_rank < 1:
        raise SystemExit(f"--dora-rank: expected a positive rank, got {args.dora_rank}")
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
    dt = jnp.dtype(args.dtype)
    layers = [(spec((args.tokens, fin), dt), spec((fin, fout), dt), spec((fin, args.dora_rank), dt),
               spec((args.dora_rank, fout), dt), spec((fout,), jnp.float32))
              for fin, fout in dora_layers(args.d_model, args.d_kv, args.d_ff)]
    operands = operands if "fp8" in ops else []
    layers = layers if "dora" in ops else []

    def model(layers, operands):  # what a model's DoRA layers (forward and backward) and FP8 projections call
        def loss(x, w, a, b, m):
            return dora.dora_dense(x, w, a, b, m, scale=2.0).astype(jnp.float32).sum()

        # the few DoRA layers first: a budget spent leaves the last of the many GEMM shapes untimed instead
        return ([jax.grad(loss, argnums=(0, 2, 3, 4))(*layer) for layer in layers],
                [fp8.scaled_matmul_nt(*o, out_dtype=jnp.dtype(args.out_dtype)) for o in operands])

    device = jax.devices()[0]
    print(f"tuning {len(operands)} GEMMs and {len(layers)} DoRA layers (rank {args.dora_rank}) on "
          f"{getattr(device, 'device_kind', device.platform)} (jax {jax.__version__}), budget {args.budget:.0f} s",
          flush=True)
    start = time.perf_counter()
    result = tune(model, layers, operands, budget_s=args.budget, cache_dir=args.cache_dir,
                  progress=not args.no_progress)
    print(f"elapsed {time.perf_counter() - start:.1f} s", flush=True)
    print(result.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
