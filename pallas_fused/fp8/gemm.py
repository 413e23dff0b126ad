"""The FP8 scaled GEMM's implementations, one object per backend, and its per-shape choice.

out = (a * sa[:, None]) @ (bt * sb[:, None])^T for a (M, K) and bt (N, K) fp8, both K-major (the layout Hopper's
wgmma reads). Each implementation answers the same four questions, so that the api asks them in one place and the
tuner has something to time:

- `supported(args, device)`: None where it computes this GEMM on this device, else why not (a sentence);
- `candidates(args, device)`: the configs worth timing, by name (the names the tuning tables keep), its default first;
- `default_config(args, device)`: the config it runs without a tuned one (the rule over the tuning table);
- `__call__(args, config)`: run it.

`XLA` (XLA's fp8 dot to fp32, then the fp32 rescale: cuBLAS on a GPU) is the reference and runs everything. `SM90`
(the Mosaic GPU kernel, kernel_sm90.py) needs Hopper, one fp8 dtype for both operands and fast accumulation. `TRITON`
(the portable Triton kernel, kernel.py) runs any fp8 pair with either accumulation from compute capability 8.9;
`INTERPRET` is the same kernel in the Pallas interpreter (CPU tests).

Plain "pallas" picks among `CHOICES`, the implementations that `supported` admits: the tuned choice at this shape
(`_tuning.choice`, looked up only where there is a choice to make), else `default_choice`. The Triton kernel is no
choice of "pallas": where the sm90 kernel does not run, XLA's fp8 dot is the faster of the two; it is forced with
implementation="pallas:triton". A forced implementation runs with its default config unless `refuses` names a
reason (its GPU was checked when the name was resolved, `_backend.resolve_implementation`).

`candidates` gives names as well as configs: the tuning tables keep the winner by name ("sm90_pingpong_s6"), and
the benchmarks time the same names.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fused import _impl, _tuning
from pallas_fused._impl import current_device as current_device  # the device the objects answer for
from pallas_fused.fp8 import kernel_sm90

# FP8 arithmetic (Triton's casts to and from float8 included) needs compute capability 8.9 (Ada) or newer.
FP8_COMPUTE_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class GemmArgs:
    """One GEMM's operands: a (M, K), bt (N, K) fp8; sa (M,), sb (N,) fp32 or 0-d scalars (one scale for every
    row); the result's dtype and whether the tensor cores may accumulate fast. Where only the choice is asked for
    (the tuner's shape keys), the operands are jax.ShapeDtypeStructs."""

    a: Any
    bt: Any
    sa: Any
    sb: Any
    out_dtype: Any
    fast_accum: bool = True

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def k(self) -> int:
        return self.a.shape[1]

    @property
    def n(self) -> int:
        return self.bt.shape[0]

    @property
    def key(self) -> str:
        """The shape key of the tuning tables (`gemm_key`)."""
        return gemm_key(self.m, self.k, self.n, self.a.dtype, self.out_dtype, self.sa.ndim > 0, self.sb.ndim > 0)

    def with_operands(self, a, bt, sa, sb, out_dtype) -> GemmArgs:
        """The same GEMM on other operands (a shard of these), of result dtype `out_dtype`."""
        return dataclasses.replace(self, a=a, bt=bt, sa=sa, sb=sb, out_dtype=out_dtype)


class Implementation(_impl.Implementation):
    """One backend of the GEMM (see the module docstring). `partitioned`: whether it runs shard by shard under the
    api's sharding rule (a Pallas kernel) or on the global arrays (XLA's dot partitions itself)."""

    op = "fp8 GEMM"
    partitioned = True

    def to_json(self, config) -> dict[str, Any]:
        """A config as the tuning tables hold it."""
        return {"impl": self.name}

    def from_json(self, data: dict[str, Any]) -> Any:
        return None


class Xla(Implementation):
    """XLA's fp8 dot (cuBLAS on a GPU) to fp32, then the fp32 rescale: the reference, for every GEMM."""

    name = "xla"
    partitioned = False

    def __call__(self, args, config=None):
        precision = None if args.fast_accum else jax.lax.Precision.HIGHEST
        acc = jax.lax.dot_general(args.a, args.bt, (((1,), (1,)), ((), ())), precision=precision,
                                  preferred_element_type=jnp.float32)
        sa = args.sa[:, None] if args.sa.ndim else args.sa
        sb = args.sb[None, :] if args.sb.ndim else args.sb
        return (acc * sa * sb).astype(args.out_dtype)


class Sm90(Implementation):
    """The Mosaic GPU kernel (kernel_sm90.py), its config a `kernel_sm90.TileConfig`: the operands padded to its
    cluster tile and tile_k, the result sliced back."""

    name = "pallas:sm90"

    def supported(self, args, device):
        if device.compute_capability is None or device.compute_capability[0] != 9:
            return f"needs a Hopper GPU (compute capability 9.0), this device has {device.compute_capability}"
        why = self.refuses(args)
        if why is not None:
            return why
        if not args.fast_accum:
            return "accumulates on the tensor cores only (fast_accum=True); fast_accum=False asks for fp32"
        return None

    def refuses(self, args):
        """Mixed fp8 dtypes: wgmma takes one element type for both operands. (fast_accum=False is no reason here: a
        forced sm90 kernel accumulates as the tensor cores do; plain "pallas" takes XLA's dot for it.)"""
        if args.a.dtype != args.bt.dtype:
            return f"needs one fp8 dtype for both operands, got {args.a.dtype} and {args.bt.dtype}"
        return None

    def default_config(self, args, device):
        return kernel_sm90.config_for(args.m, args.n, args.k, device.num_sms, args.out_dtype)

    def candidates(self, args, device):
        """The rule's tile first, then the cooperative tile (where the rule's is the table's ping-pong one) and the
        ping-pong tiles (`kernel_sm90.pingpong_tiles`), each with its ring fitted to the result's staging; each
        config once."""
        m, n, k = args.m, args.n, args.k
        others = {"sm90_cooperative": kernel_sm90.tile_for(m, n, k, device.num_sms, pingpong=False),
                  **kernel_sm90.pingpong_tiles(m, n, k, device.num_sms)}
        found = {"sm90": self.default_config(args, device)}
        for name, tile in others.items():
            config = kernel_sm90.fit_stages(tile, args.out_dtype)
            if config not in found.values():
                found[name] = config
        return found

    def __call__(self, args, config):
        cm, cn = config.cluster_tile
        out = kernel_sm90.scaled_matmul_nt(
            pad_to(args.a, cm, config.tile_k), pad_to(args.bt, cn, config.tile_k), pad_vec(args.sa, cm),
            pad_vec(args.sb, cn), out_dtype=jnp.dtype(args.out_dtype), config=config)  # a scalar: a (1,) vector
        return out[:args.m, :args.n]

    def to_json(self, config):
        return {"impl": self.name, "tile": dataclasses.asdict(config)}

    def from_json(self, data):
        return kernel_sm90.TileConfig(**data["tile"])


class Triton(Implementation):
    """The portable Triton kernel (kernel.py): any fp8 pair, either accumulation; in the Pallas interpreter where
    `interpret` (named "interpret" then, and running on any device)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.name = "interpret" if interpret else "pallas:triton"

    def supported(self, args, device):
        if self.interpret or (device.compute_capability or (0, 0)) >= FP8_COMPUTE_CAPABILITY:
            return None
        return (f"needs a GPU of compute capability {FP8_COMPUTE_CAPABILITY[0]}.{FP8_COMPUTE_CAPABILITY[1]} or "
                f"newer (fp8 arithmetic), this device has {device.compute_capability}")

    def __call__(self, args, config=None):
        from pallas_fused.fp8 import kernel

        sa, sb = jnp.broadcast_to(args.sa, (args.m,)), jnp.broadcast_to(args.sb, (args.n,))
        return kernel.scaled_matmul_nt(args.a, args.bt, sa, sb, out_dtype=jnp.dtype(args.out_dtype),
                                       interpret=self.interpret)


XLA, SM90, TRITON, INTERPRET = Xla(), Sm90(), Triton(interpret=False), Triton(interpret=True)
IMPLEMENTATIONS = {impl.name: impl for impl in (XLA, SM90, TRITON, INTERPRET)}
CHOICES = (SM90, XLA)  # what plain "pallas" picks among


def pad_to(x, rows, cols):
    pr, pc = -x.shape[0] % rows, -x.shape[1] % cols
    return x if pr == pc == 0 else jnp.pad(x, ((0, pr), (0, pc)))


def pad_vec(v, multiple):
    """v padded with ones to a multiple of `multiple`; a scalar as a (1,) vector."""
    if v.ndim == 0:
        return v.reshape(1)
    p = -v.shape[0] % multiple
    return v if p == 0 else jnp.pad(v, (0, p), constant_values=1.0)


# ----------------------------------------------------------------------------------------------
# plain "pallas": the tuned choice, else the rule


def default_choice(args: GemmArgs, device: _tuning.Device) -> Implementation:
    """The rule: the sm90 kernel where it runs, unless `kernel_sm90.cublas_wins` at this shape; else XLA's dot."""
    if SM90.supported(args, device) is None and not kernel_sm90.cublas_wins(args.m, args.n, args.k, device.num_sms):
        return SM90
    return XLA


def choose(args: GemmArgs, device: _tuning.Device) -> tuple[Implementation, Any]:
    """(implementation, config) for plain "pallas": the tuned entry at this shape where more than one of `CHOICES`
    runs it, else `default_choice`; config None: the implementation's default for the shape it runs (a shard's own
    under sharding)."""
    runs = [impl for impl in CHOICES if impl.supported(args, device) is None]
    if len(runs) > 1:
        entry = _tuning.choice(GEMM_OP, args.key)
        for impl in runs:
            if entry is not None and entry["config"].get("impl") == impl.name:
                return impl, impl.from_json(entry["config"])
    return default_choice(args, device), None


# ----------------------------------------------------------------------------------------------
# the tuner's view (pallas_fused/_tuning.py): shape keys, candidates as JSON, a timed call

GEMM_OP = "fp8_gemm"
_SCALES = {(True, True): "rowwise", (False, False): "tensorwise", (True, False): "rowwise,tensorwise",
           (False, True): "tensorwise,rowwise"}


def gemm_key(m, k, n, dtype, out_dtype, a_rowwise: bool, b_rowwise: bool) -> str:
    """The shape key of an (M, K) x (N, K) GEMM of `dtype` operands to `out_dtype`, with a scale per row of a (of bt)
    or one for all: "16384x2048x5504 float8_e4m3fn bfloat16 rowwise" (M x K x N, as the benchmarks name cases)."""
    return f"{m}x{k}x{n} {jnp.dtype(dtype).name} {jnp.dtype(out_dtype).name} {_SCALES[a_rowwise, b_rowwise]}"


def args_of_key(key: str) -> GemmArgs:
    """The GEMM a shape key names, its operands as jax.ShapeDtypeStructs (keys are looked up with fast
    accumulation only: where the sm90 kernel is a choice)."""
    dims, dtype, out_dtype, scales = key.split(" ")
    m, k, n = (int(d) for d in dims.split("x"))
    row_a, row_b = {v: k for k, v in _SCALES.items()}[scales]
    spec = jax.ShapeDtypeStruct
    return GemmArgs(spec((m, k), jnp.dtype(dtype)), spec((n, k), jnp.dtype(dtype)),
                    spec((m,) if row_a else (), jnp.float32), spec((n,) if row_b else (), jnp.float32),
                    jnp.dtype(out_dtype))


def gemm_candidates(key: str) -> dict[str, dict]:
    """The configs the tuner times at shape `key` on this device, as JSON: each implementation of `CHOICES` that
    runs it, the rule's choice first; first every such implementation's default config, then their other
    candidates; each config once."""
    args, device = args_of_key(key), current_device()
    first = default_choice(args, device)
    runs = sorted((impl for impl in CHOICES if impl.supported(args, device) is None), key=lambda i: i is not first)
    named = [[(name, impl.to_json(config)) for name, config in impl.candidates(args, device).items()] for impl in runs]
    found: dict[str, dict] = {}
    for name, config in [c[0] for c in named] + [x for c in named for x in c[1:]]:
        if config not in found.values():
            found[name] = config
    return found


@functools.lru_cache(maxsize=1)  # the candidates of one shape are timed one after another, on the same operands
def gemm_operands(key: str):
    """Distinct random operand sets of the GEMM at shape `key` that pass the 50 MB L2 together (at most 8), so that
    a call over them reads HBM as a training step's GEMMs do: normal fp8 codes (never zeros), scales in [0.5, 2)."""
    args = args_of_key(key)

    def operands(seed):
        ka, kb, ksa, ksb = jax.random.split(jax.random.key(seed), 4)
        return (jax.random.normal(ka, args.a.shape).astype(args.a.dtype),
                jax.random.normal(kb, args.bt.shape).astype(args.bt.dtype),
                jax.random.uniform(ksa, args.sa.shape, jnp.float32, 0.5, 2.0),
                jax.random.uniform(ksb, args.sb.shape, jnp.float32, 0.5, 2.0))

    m, k, n = args.m, args.k, args.n
    return [operands(seed) for seed in range(min(8, max(1, math.ceil(100e6 / (m * k + n * k + 2 * m * n)))))]


def gemm_build(key: str, config: dict, sets=None):
    """A call running the GEMM at shape `key` with `config` (a candidate's JSON) once on each operand set (a, bt, sa,
    sb) of `sets` (default `gemm_operands(key)`), in one jit (the host's dispatch amortized), and the number of GEMMs
    it runs."""
    args, sets = args_of_key(key), gemm_operands(key) if sets is None else sets
    impl = IMPLEMENTATIONS[config["impl"]]
    tile = impl.from_json(config)
    many = jax.jit(lambda sets: [impl(args.with_operands(a, bt, sa, sb, args.out_dtype), tile)
                                 for a, bt, sa, sb in sets])
    return (lambda: many(sets)), len(sets)


_tuning.register(GEMM_OP, _tuning.Tunable(candidates=gemm_candidates, build=gemm_build))
