"""Embedding lookup at the example's shapes (16 x 1024 tokens, d_model 2048, bf16 activations, fp32 table):
forward and forward+backward, ours against the XLA reference (nn.Embed's gather and scatter-add gradient).

impls: "user:embed" (the public `embed` under jit, default implementation), "xla" (the reference: what
nn.Embed computes, the example's baseline), "pallas" (the one-hot GEMM gradient, heuristic launch config, or
the sorted segment sum above `ONEHOT_MAX_VOCAB`), "pallas:<variant>" (other launch configs of the kernel).

Ids: "uniform" draws every row alike; "skewed" draws row floor(V u^3) (a few rows take most tokens, as the
bytes of text do: the case where a scatter's atomics collide most).

Bytes: the fewest a lookup moves: the table once (fp32), the ids, the (N, D) bf16 output; the backward reads
dy and the ids and writes the fp32 table gradient. FLOPs (pallas rows with the one-hot kernel): 2 V N D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.common import Recorder, rnd
from pallas_fused._backend import resolve_implementation
from pallas_fused.embed import ONEHOT_MAX_VOCAB, embed
from pallas_fused.embed.api import embed_with_config
from pallas_fused.embed.kernel import choose_config

OP = "embed"
TOKENS = (16, 1024)
FEATURES = 2048
CASES = [(256, "uniform"), (256, "skewed"), (1024, "skewed"), (32000, "skewed")]
QUICK_CASES = CASES[1:2] + CASES[3:]


def _ids(vocab: int, kind: str):
    u = jax.random.uniform(jax.random.key(5), TOKENS)
    ids = jnp.floor(vocab * (u if kind == "uniform" else u**3))
    return jnp.minimum(ids, vocab - 1).astype(jnp.int32)


def _variants(tokens: int, vocab: int, quick: bool) -> dict:
    """The heuristic geometry and, beside it, other token splits and tile sizes (to check the heuristic)."""
    base = choose_config(tokens, vocab, FEATURES)
    out = {"pallas": None}
    if quick or vocab > ONEHOT_MAX_VOCAB:
        return out
    for splits in (1, 2 * base.splits, max(1, base.splits // 2)):
        out[f"pallas:splits{splits}"] = base.__class__(base.block_vocab, base.block_features, base.block_tokens,
                                                       splits, base.num_warps)
    out["pallas:bd64_w4"] = base.__class__(base.block_vocab, 64, base.block_tokens, base.splits * 2, 4)
    out["pallas:bt32"] = base.__class__(base.block_vocab, base.block_features, 32, base.splits, base.num_warps)
    return {k: v for k, v in out.items() if v is None or v != base}


def _fns(ids, impl, config):
    def fwd(table):
        if impl == "user":
            return embed(table, ids, dtype=jnp.bfloat16)
        return embed_with_config(table, ids, dtype=jnp.bfloat16, implementation=impl, config=config)

    def fwdbwd(table, dy):
        out, vjp = jax.vjp(fwd, table)  # the output is returned: in training it feeds the first block
        return out, vjp(dy)

    return jax.jit(fwd), jax.jit(fwdbwd)


def run(rec: Recorder, quick: bool) -> None:
    n_tok = TOKENS[0] * TOKENS[1]
    dy = rnd(2, TOKENS + (FEATURES,), jnp.bfloat16)
    for vocab, kind in (QUICK_CASES if quick else CASES):
        table = rnd(1, (vocab, FEATURES), jnp.float32)
        ids = _ids(vocab, kind)
        fwd_bytes = vocab * FEATURES * 4 + n_tok * 4 + n_tok * FEATURES * 2
        bwd_bytes = n_tok * FEATURES * 2 + n_tok * 4 + vocab * FEATURES * 4
        case = f"N{n_tok} V{vocab} D{FEATURES} {kind}"
        impls = {"user:embed": ("user", None), "xla": ("xla", None)}
        impls.update({name: ("pallas", cfg) for name, cfg in _variants(n_tok, vocab, quick).items()})
        for name, (impl, cfg) in impls.items():
            extra = {} if cfg is None else {"config": str(cfg)}
            runs_kernel = impl == "pallas" or (impl == "user" and resolve_implementation(None, op=OP) == "pallas")
            onehot = runs_kernel and vocab <= ONEHOT_MAX_VOCAB
            flops = 2 * vocab * n_tok * FEATURES if onehot else None
            fwd, fwdbwd = _fns(ids, impl, cfg)
            rec.time(OP, f"{case} fwd", name, fwd, table, n=20 if quick else 50, nbytes=fwd_bytes, **extra)
            rec.time(OP, f"{case} fwd+bwd", name, fwdbwd, table, dy, n=20 if quick else 50,
                     nbytes=fwd_bytes + bwd_bytes, flops=flops, **extra)
