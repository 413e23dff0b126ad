"""Rotary embeddings of q and k (bf16): forward and forward+backward, and a decode step.

impls: "user:apply_rotary" (the row of record: the public `apply_rotary(q, k, positions)` under jit, default
implementation), "pallas" (the fused kernel through `apply_rotary_with_config`, heuristic launch config),
"pallas:<variant>" (other launch configs, to check the heuristic), "xla" (our jnp reference under jit: the
same math as the peer in ../shared/peers/peers_jax.py, which is what a JAX user writes), "peer:torch_compile"
(the same rotary in torch, torch.compile'd; forward, and forward+backward through autograd).

fwd+bwd returns the rotated q, k and their gradients (the forward output is used, as in training).

Bytes: the fewest an implementation must move: read q and k, write q_rot and k_rot (+ the int32
positions); forward+backward counts that twice (the backward reads the two cotangents and writes the two
gradients). cos/sin are computed from the positions, so no table is counted.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Recorder, bench_torch, error_text, rnd
from pallas_fused.rotary.api import apply_rotary, apply_rotary_with_config
from pallas_fused.rotary.kernel import choose_config

OP = "rotary"

# (B, S, Hq, Hk, D, positions kind): the two ANCHORS.md training shapes and a decode step far into a
# long context (S=1 per row, each row at its own position ~1e5: positions of shape (B, 1)).
CASES = [
    (4, 4096, 32, 8, 128, "arange"),
    (8, 2048, 32, 32, 128, "arange"),
    (64, 1, 32, 8, 128, "decode"),
]
QUICK_CASES = CASES[:1] + CASES[2:]
SWEEP_SECONDS = 60.0  # for the "pallas:<variant>" rows of all cases together (the default rows always run)


def _positions(batch, seq_len, kind):
    if kind == "arange":
        return jnp.arange(seq_len, dtype=jnp.int32)
    return jax.random.randint(jax.random.key(7), (batch, seq_len), 100_000, 110_000, dtype=jnp.int32)


def _variants(batch, seq_len, hq, hk, d, quick):
    """Launch configs to time beside the heuristic, most telling first (the sweep is time-bounded):
    cos/sin "fast" (range reduction + sin/cos.approx) against "precise"; load modes (the first default,
    evict_first, let LLVM sink the q/k loads below the cos/sin branches; "volatile" keeps program order);
    then tokens per program and warps. Names: pallas:<trig>_<load mode>[_bt<B>][_w<W>]."""
    from pallas_fused import _backend

    sms = _backend.num_sms()
    pick = lambda **kw: choose_config(batch, seq_len, hq, hk, d // 2, 0, 2, sms, **kw)  # noqa: E731
    base = pick()
    out = {"pallas": None}
    if quick:
        return out
    w = base.num_warps
    bt = base.block_tokens
    wanted = [dict(trig="fast"), dict(trig="precise", load_mode="evict_first"), dict(trig="fast", load_mode="volatile"),
              dict(trig="precise", load_mode="volatile"), dict(trig="fast", num_warps=max(w // 2, 1)),
              dict(trig="fast", num_warps=min(w * 2, 8)), dict(trig="precise", num_warps=max(w // 2, 1)),
              dict(trig="fast", block_tokens=bt * 2), dict(trig="fast", load_mode="evict_first")]
    for kw in wanted:
        cfg = pick(**kw)
        name = f"pallas:{cfg.trig}_{cfg.load_mode}"
        name += f"_bt{cfg.block_tokens}" if "block_tokens" in kw else ""
        name += f"_w{cfg.num_warps}" if "num_warps" in kw else ""
        if cfg != base and cfg not in out.values():
            out[name] = cfg
    return out


def _jax_fns(positions, config, impl):
    def fwd(q, k):
        if impl == "user":
            return apply_rotary(q, k, positions)
        return apply_rotary_with_config(q, k, positions, implementation=impl, config=config)

    def fwdbwd(q, k, gq, gk):
        # Return the forward outputs too: in training they feed attention, so the forward kernel must run
        # (returning only the gradients would let XLA drop it, and the time would be the backward alone).
        out, vjp = jax.vjp(fwd, q, k)
        return out, vjp((gq, gk))

    return jax.jit(fwd), jax.jit(fwdbwd)


def _torch_peer(rec: Recorder, case: str, q, k, positions, gq, gk, nbytes: float, decode: bool):
    try:
        import torch
    except ImportError:
        return
    try:
        dev = "cuda"
        to_t = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(dev, torch.bfloat16)
        tq, tk, tgq, tgk = to_t(q), to_t(k), to_t(gq), to_t(gk)
        tpos = torch.from_numpy(np.asarray(positions)).to(dev)
        d = q.shape[-1]

        def rope(q, k, pos):
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
            freqs = pos.float()[..., None] * inv
            c, s = freqs.cos().unsqueeze(-2), freqs.sin().unsqueeze(-2)

            def rot(x):
                x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
                return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)

            return rot(q), rot(k)

        compiled = torch.compile(rope)
        with torch.no_grad():
            ms = bench_torch(lambda: compiled(tq, tk, tpos))
        rec.add(OP, f"{case} fwd", "peer:torch_compile", ms, nbytes=nbytes)
        if decode:
            return
        tq.requires_grad_(True)
        tk.requires_grad_(True)

        def fb():
            oq, ok = compiled(tq, tk, tpos)
            return torch.autograd.grad((oq, ok), (tq, tk), (tgq, tgk))

        ms = bench_torch(fb)
        rec.add(OP, f"{case} fwd+bwd", "peer:torch_compile", ms, nbytes=2 * nbytes)
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
        rec.add(OP, f"{case} fwd", "peer:torch_compile", None, error=error_text(e))


def run(rec: Recorder, quick: bool) -> None:
    deadline = time.perf_counter() + SWEEP_SECONDS  # variants past it are recorded as skipped
    for batch, seq_len, hq, hk, d, kind in (QUICK_CASES if quick else CASES):
        q, k = rnd(1, (batch, seq_len, hq, d), jnp.bfloat16), rnd(2, (batch, seq_len, hk, d), jnp.bfloat16)
        gq, gk = rnd(3, q.shape, jnp.bfloat16), rnd(4, k.shape, jnp.bfloat16)
        positions = _positions(batch, seq_len, kind)
        nbytes = 2 * (q.size + k.size) * 2 + positions.size * 4
        case = f"B{batch} S{seq_len} Hq{hq} Hk{hk} D{d}" + (" pos~1e5" if kind == "decode" else "")
        decode = kind == "decode"
        n = 20 if quick else 50
        impls = {"user:apply_rotary": ("user", None), "xla": ("xla", None)}
        for name, cfg in _variants(batch, seq_len, hq, hk, d, quick).items():
            impls[name] = ("pallas", cfg)
        # The rows of record and the reference, timed in turn (the first of several ~0.1 ms ops timed one after
        # another can run slower than the same call later); the launch sweep's variants after them, one by one.
        main = {name: _jax_fns(positions, cfg, impl) + (cfg,) for name, (impl, cfg) in impls.items()
                if not name.startswith("pallas:")}
        extra = lambda cfg: {} if cfg is None else {"config": str(cfg)}  # noqa: E731
        rec.time_interleaved(OP, f"{case} fwd", {name: (fwd, (q, k), extra(cfg)) for name, (fwd, _, cfg)
                                                 in main.items()}, n=n, nbytes=nbytes)
        if not decode:
            rec.time_interleaved(OP, f"{case} fwd+bwd", {name: (fwdbwd, (q, k, gq, gk), extra(cfg)) for name,
                                                         (_, fwdbwd, cfg) in main.items()}, n=n, nbytes=2 * nbytes)
        for name, (impl, cfg) in impls.items():
            if name in main:
                continue
            if time.perf_counter() > deadline:
                rec.add(OP, f"{case} fwd", name, None, error=f"skipped: sweep time ({SWEEP_SECONDS:.0f} s) used up",
                        **extra(cfg))
                continue
            fwd, fwdbwd = _jax_fns(positions, cfg, impl)
            rec.time(OP, f"{case} fwd", name, fwd, q, k, n=n, nbytes=nbytes, **extra(cfg))
            if not decode:
                rec.time(OP, f"{case} fwd+bwd", name, fwdbwd, q, k, gq, gk, n=n, nbytes=2 * nbytes, **extra(cfg))
        _torch_peer(rec, case, q, k, positions, gq, gk, nbytes, decode)
