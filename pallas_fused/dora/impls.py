"""DoRA's implementations, one object per backend and variant, and plain "pallas"'s choice among them.

y = (x W + s (x A) B) g + bias, g = m / ||W + s A B|| per output column. Each implementation answers the same four
questions (as the FP8 GEMM's, fp8/gemm.py), so that the api asks them in one place and a tuner has something to
time:

- `supported(args, device)`: None where it computes this layer on this device, else why not (a sentence);
- `candidates(args, device)`: the configs worth timing, by name, its default first;
- `default_config(args, device)`: the config it runs without one given (the Pallas kernels' tiles, `dora.Config`);
- `__call__(args, config)`: run it (a custom_vjp: the backward is the implementation's too).

`XLA` is the plain-jnp reference and runs everything. The Pallas variants ("pallas:<variant>", "interpret:<variant>"
in the Pallas interpreter) differ in how they run the two big GEMMs, x W and dx = dy (W + s A B)^T; the column norm
and the backward's column reductions are Pallas kernels in every one of them:

- `Sm90`: one Mosaic GPU GEMM each way with the low-rank product in its accumulator (kernel_sm90.py; Hopper, dense
  16-bit W, tile-multiple shapes);
- `Merged`: one Pallas pass forms (W + s A B) g, then cuBLAS (any weight);
- `Epilogue`: cuBLAS x W, then one Pallas pass (x W + s (x A) B) g + bias (dense W);
- `Sm90Dequant`: the Mosaic GPU GEMMs over an Int8Kernel's codes, dequantised in registers (Hopper);
- `Gemm`: Triton GEMMs both ways, W dequantised in-kernel (any weight; the least memory, the slowest).

Plain "pallas" (and "interpret") takes `choose`'s pick, a pure function of the shapes, the dtype and the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fused import _backend, _impl, _sharding, _tuning
from pallas_fused._impl import current_device as current_device  # the device the objects answer for
from pallas_fused.dora import kernel_columns, kernel_gemm, kernel_merge, kernel_norm, kernel_sm90, reference
from pallas_fused.dora.config import DEFAULT, Config
from pallas_fused.dora.kernel_util import pow2
from pallas_fused.dora.quant import Int8Kernel, NF4Kernel


@dataclasses.dataclass(frozen=True)
class DoraArgs:
    """One DoRA layer's operands: x (..., in) in the compute dtype; kernel W (in, out), or an Int8Kernel / NF4Kernel;
    lora_a A (in, rank) and lora_b B (rank, out) in x's dtype; magnitude m (out,); bias (out,) in x's dtype or None;
    scale s; whether the norm is differentiated. Where only the choice is asked for, the arrays are
    jax.ShapeDtypeStructs (`shaped`)."""

    x: Any
    kernel: Any
    lora_a: Any
    lora_b: Any
    magnitude: Any = None
    bias: Any = None
    scale: Any = 1.0
    exact_norm_grad: bool = False

    @classmethod
    def shaped(cls, kind: str, tokens: int, fin: int, fout: int, rank: int, dtype) -> DoraArgs:
        """A layer of `tokens` tokens, fin -> fout at `rank`, x of `dtype` and a `kind` weight ("dense", "int8",
        "nf4"), as shapes only."""
        spec: Any = jax.ShapeDtypeStruct  # standing in for the arrays
        kernel = {"dense": lambda: spec((fin, fout), dtype),
                  "int8": lambda: Int8Kernel(spec((fin, fout), jnp.int8), spec((fout,), jnp.float32)),
                  "nf4": lambda: NF4Kernel(spec((-(-fin // 128) * 64, fout), jnp.uint8),
                                           spec((-(-fin // 128) * 2, fout), jnp.float32), fin)}[kind]()
        return cls(spec((tokens, fin), dtype), kernel, spec((fin, rank), dtype), spec((rank, fout), dtype),
                   spec((fout,), jnp.float32))

    @property
    def kind(self) -> str:
        """The weight's format: "dense", "int8" or "nf4"."""
        return "int8" if isinstance(self.kernel, Int8Kernel) else "nf4" if isinstance(self.kernel, NF4Kernel) \
            else "dense"

    @property
    def tokens(self) -> int:
        return math.prod(self.x.shape[:-1])

    @property
    def fin(self) -> int:
        return self.lora_a.shape[0]

    @property
    def fout(self) -> int:
        return self.lora_b.shape[1]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[1]

    @property
    def padded_rank(self) -> int:
        """The rank the kernels run at (`pad_rank`)."""
        return pow2(self.rank)

    @property
    def dtype(self):
        return jnp.dtype(self.x.dtype)

    @property
    def layer_key(self) -> str:
        """The shape key of the tuning tables (`kernel_sm90.layer_key`), at the padded rank."""
        return kernel_sm90.layer_key(self.tokens, self.fin, self.fout, self.padded_rank, self.dtype, self.kind)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What the custom_vjp's forward and backward hold fixed: the implementation, the weight's format, the config, the
    norm's differentiation, the adapters' rank (before padding) and in_features."""

    impl: Implementation
    kind: str
    config: Config
    exact: bool
    rank: int
    fin: int


class Implementation(_impl.Implementation):
    """One backend of the layer (see the module docstring). `entry`: its `VARIANTS` entry (None for XLA)."""

    op = "DoRA"
    variant = ""
    entry: _backend.Variant | None = None

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    @property
    def name(self) -> str:
        return f"{'interpret' if self.interpret else 'pallas'}:{self.variant}"

    def candidates(self, args: DoraArgs, device: _tuning.Device) -> dict[str, Any]:
        return {self.variant: self.default_config(args, device)}

    def default_config(self, args: DoraArgs, device: _tuning.Device) -> Any:
        return DEFAULT

    def __call__(self, args: DoraArgs, config: Config) -> jax.Array:
        """y (tokens, out) for a 2-D x."""
        kind, ops = weight_ops(args.kernel, args.dtype)
        layer = _Layer(self, kind, config, bool(args.exact_norm_grad), args.rank, args.fin)
        return _dora_2d(layer, args.x, ops, args.lora_a, args.lora_b, args.magnitude, args.bias,
                        jnp.asarray(args.scale, jnp.float32))

    # The custom_vjp's variant-specific parts (`_dora_2d_fwd`, `_dora_2d_bwd` hold the rest).

    def forward(self, st: _Layer, x, ops, ap, bp, m, bias, scale):
        """(y, (n, g, x A or None, (merged weight or None, B g s or None))) on the rank-padded adapters."""
        raise NotImplementedError

    def dyg_scale(self, g, ops):
        """The column scale the backward's column launch puts on dy (its 4th result) for `dx`, or None."""
        return None

    def dx(self, st: _Layer, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        """dx = (dy g) (W + s A B)^T, given us = s (dy g) B^T; `finished`: the column launch's results, or None."""
        raise NotImplementedError


class Xla(Implementation):
    """The plain-jnp reference (reference.py), for every layer."""

    @property
    def name(self) -> str:
        return "xla"

    def default_config(self, args, device):
        return None

    def candidates(self, args, device):
        return {"xla": None}

    def __call__(self, args, config=None):
        """y (..., out) for any x."""
        return reference.dora_dense_reference(args.x, args.kernel, args.lora_a, args.lora_b, args.magnitude,
                                              args.bias, scale=args.scale, exact_norm_grad=args.exact_norm_grad)


def _hopper_refuses(interpret: bool, device: _tuning.Device) -> str | None:
    """Why a Mosaic GPU kernel cannot run on this device (interpreted: in this jax), or None. One device only: the
    kernels have no sharding rule."""
    if interpret and not _backend.has_mosaic_interpret():
        return "runs in Mosaic GPU's interpret mode, which needs jax >= 0.12"
    cc = device.compute_capability
    if not interpret and (cc is None or cc[0] != 9):
        return f"needs a Hopper GPU (compute capability 9.0), this device has {cc}"
    if jax.device_count() != 1:
        return f"runs on one device, this process has {jax.device_count()}"
    return None


class Sm90(Implementation):
    """One Mosaic GPU GEMM each way (kernel_sm90.scaled_matmul), the low-rank product in its accumulator, g and the
    bias in its epilogue: W + s A B is never formed."""

    variant = "sm90"
    entry = _backend.Variant(
        "the column norm's read-only pass over W, then one Mosaic GPU GEMM (x W + (x A)(s B)) g + bias each way "
        "(dx = (dy g) W^T + ((dy g)(s B)^T) A^T): W is never merged (Hopper, dense 16-bit W, tile-multiple shapes)",
        needs=(9, 0), mosaic=True)

    def supported(self, args, device):
        if args.kind != "dense":
            return f"needs a dense 16-bit kernel, got an {type(args.kernel).__name__}"
        return (_hopper_refuses(self.interpret, device)
                or kernel_sm90.layer_refuses(args.tokens, args.fin, args.fout, args.dtype, args.padded_rank))

    def default_config(self, args, device):
        """`DEFAULT` with the tiles at this layer's shape: the tuned ones, else the rule's (`kernel_sm90.layer_tiles`,
        looked up while the layer is traced)."""
        return dataclasses.replace(DEFAULT, sm90=kernel_sm90.layer_tiles(args.tokens, args.fin, args.fout,
                                                                          args.padded_rank, args.dtype))

    def candidates(self, args, device):
        """`DEFAULT` with each of `kernel_sm90.candidate_tiles` at this layer's shape, the rule's first."""
        return {name: dataclasses.replace(DEFAULT, sm90=tiles) for name, tiles in kernel_sm90.candidate_tiles(
            args.tokens, args.fin, args.fout, args.padded_rank, args.dtype).items()}

    def __call__(self, args, config):
        """y (tokens, out) for a 2-D x; the GEMMs' tiles `config.sm90`, where None (a config of the user's) the
        default config's."""
        if config.sm90 is None:
            config = dataclasses.replace(config, sm90=self.default_config(args, current_device()).sm90)
        return super().__call__(args, config)

    def tuned(self, args: DoraArgs, device: _tuning.Device) -> bool:
        """Whether plain "pallas" takes it (DoRA's "sm90", `lora_dense`'s kernels): where it runs, up to the tuned
        padded rank (`kernel_sm90.max_rank`: its low-rank slices shrink the GEMM's ring)."""
        return args.padded_rank <= kernel_sm90.max_rank() and self.supported(args, device) is None

    def tunable(self, args: DoraArgs, device: _tuning.Device) -> bool:
        """Whether plain "pallas" may take it by a tuned entry: a dense layer on one Hopper GPU, up to the tuned
        padded rank, whose shape some of its candidate tiles run (the rule's tiles need not)."""
        return (args.kind == "dense" and args.padded_rank <= kernel_sm90.max_rank()
                and _hopper_refuses(self.interpret, device) is None
                and bool(kernel_sm90.candidate_tiles(args.tokens, args.fin, args.fout, args.padded_rank, args.dtype)))

    def forward(self, st, x, ops, ap, bp, m, bias, scale):
        # y = (x W + (x A)(s B)) g + bias in one Mosaic GPU GEMM (the low-rank product in its accumulator, g and the
        # bias in its epilogue), g from the column norm's read-only pass over W: W + s A B is never written. x A is
        # kept for the backward (its column sums and dA need it).
        n, g = column_norm_scale(ops, st.kind, ap, bp, scale, m, self.interpret, st.config)
        xa = _xa(x, ap)
        sb = (bp.astype(jnp.float32) * scale).astype(x.dtype)
        y = kernel_sm90.scaled_matmul(x, ops[0], g, bias, lowrank=(xa, sb), config=st.config.sm90.forward,
                                      interpret=self.interpret)
        return y, (n, g, xa, (None, None))

    def dyg_scale(self, g, ops):
        return g

    def dx(self, st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        # dx = (dy g) W^T + us A^T in one Mosaic GPU GEMM; dy g is written by the column launch (it reads dy anyway)
        # where that launch ran, by XLA otherwise.
        dyg = finished[3] if finished is not None else (dy.astype(jnp.float32) * g[None, :]).astype(x.dtype)
        return kernel_sm90.scaled_matmul(dyg, ops[0], lowrank=(us, ap), b_layout="nk", config=st.config.sm90.dx,
                                         interpret=self.interpret)


class Merged(Implementation):
    """One Pallas pass forms (W + s A B) g, then one cuBLAS GEMM; any weight."""

    variant = "merged"
    entry = _backend.Variant(
        "one Pallas pass forms (W + s A B) g, then one cuBLAS GEMM; any weight (QDoRA at cuBLAS speed: the merged "
        "weight of an Int8Kernel / NF4Kernel is a transient full-precision array, formed again in the backward)")

    def forward(self, st, x, ops, ap, bp, m, bias, scale):
        # y = x ((W + s A B) g) + bias: one cuBLAS GEMM on the merged weight (x A is left to the backward). The
        # merged weight is kept for the backward's dx = dy wm^T (one bf16 copy of W per layer in memory).
        n, g, wm, bg = _norm_and_merged_weight(st.kind, ops, ap, bp, scale, m, self.interpret, st.config)
        saved = (wm, bg) if _keeps_merged(st.config, st.kind) else (None, bg)
        # The bias is added in the compute dtype: cuBLAS adds it in its epilogue where XLA fuses it (a float32
        # product would be written and read back in full otherwise, 2 x 4 bytes per output).
        y = jnp.dot(x, wm) if bias is None else jnp.dot(x, wm) + bias
        return y, (n, g, None, saved)

    def dx(self, st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        return _cublas_dx(st, self.interpret, ops, ap, bp, g, scale, dy, us, wm)


class Epilogue(Implementation):
    """cuBLAS x W, then one Pallas pass (x W + s (x A) B) g + bias; dense W."""

    variant = "epilogue"
    entry = _backend.Variant("cuBLAS x W, then one Pallas pass (x W + s (x A) B) g + bias; dense W")

    def supported(self, args, device):
        if args.kind != "dense":
            return "takes a dense kernel only; use 'pallas' (or 'pallas:merged' for an Int8Kernel)"
        return None

    def forward(self, st, x, ops, ap, bp, m, bias, scale):
        n, g = column_norm_scale(ops, st.kind, ap, bp, scale, m, self.interpret, st.config)
        xa = _xa(x, ap)
        # cuBLAS z = x W (rounded once to the compute dtype), then one Pallas pass: (z + s xa B) g + bias.
        w = ops[0].astype(x.dtype)

        def epi(z, *a):  # sharded: tokens and output features split, the rank gathered
            return kernel_gemm.epilogue(z, *a[:4], a[4] if len(a) > 4 else None, interpret=self.interpret,
                                        config=st.config.epilogue)

        rule = "m n, m r, r n, n, " + ("" if bias is None else ", n") + " -> m n"
        y = _shard(epi, "dense", rule, replicated=("r",))(jnp.dot(x, w), xa, bp, g, scale,
                                                          *(() if bias is None else (bias,)))
        return y, (n, g, xa, (None, None))

    def dx(self, st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        return _cublas_dx(st, self.interpret, ops, ap, bp, g, scale, dy, us, wm)


class Sm90Dequant(Implementation):
    """An Int8Kernel's Mosaic GPU GEMMs (kernel_sm90.qdora_forward / qdora_dx): the int8 tiles dequantised in
    registers, the low-rank term in the same accumulator; W is never formed in full precision."""

    variant = "sm90_dequant"
    entry = _backend.Variant(
        "Int8Kernel on Hopper: the column norm from the codes in-kernel, then one Mosaic GPU GEMM (x W + s (x A) B) g "
        "+ bias with W's int8 tiles dequantised in registers and the low-rank term in the same accumulator; the "
        "dx GEMM the same way over W^T (tile-multiple shapes; W never formed in full)", needs=(9, 0), mosaic=True)

    def supported(self, args, device):
        if args.kind != "int8":
            return f"needs an Int8Kernel, got {'a dense kernel' if args.kind == 'dense' else 'an NF4Kernel'}"
        return (_hopper_refuses(self.interpret, device)
                or kernel_sm90.qdora_layer_refuses(args.tokens, args.fin, args.fout, args.dtype, args.padded_rank))

    def forward(self, st, x, ops, ap, bp, m, bias, scale):
        # y = (x q + xa (s B / wscale)) (g wscale) + bias in one Mosaic GPU GEMM: q's int8 tiles converted in
        # registers (exact in 16 bits), the per-column int8 scale with g in the epilogue, so the low-rank operand
        # (rank x out, tiny) carries 1 / wscale. The GEMM's int8 operand is q^T, written by the column norm's pass
        # over the codes with the columns of scale 0 zeroed: those take scale 1, so their low-rank term stays and
        # their x W is 0, with no branch.
        n, g, qt = kernel_norm.column_norm_scale(ops, st.kind, ap, bp, scale, m, interpret=self.interpret,
                                                 config=st.config.norm, transposed_codes=True)
        xa = _xa(x, ap)
        wscale = jnp.where(ops[1] == 0, 1.0, ops[1])
        lb = (bp.astype(jnp.float32) * (scale / wscale)[None, :]).astype(x.dtype)
        y = kernel_sm90.qdora_forward(x, qt, xa, lb, g * wscale, bias, interpret=self.interpret)
        return y, (n, g, xa, (None, None))

    def dyg_scale(self, g, ops):
        return g * ops[1]  # dx = (dy g wscale) q^T + us A^T: the int8 scale is per contraction index there, on dy

    def dx(self, st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        dyg = finished[3] if finished is not None else (dy.astype(jnp.float32) * dyg_scale[None, :]).astype(x.dtype)
        return kernel_sm90.qdora_dx(dyg, ops[0], us, ap, interpret=self.interpret)


class Gemm(Implementation):
    """Triton GEMMs both ways (kernel_gemm: the fused-epilogue forward, the dx GEMM), W dequantised in-kernel."""

    variant = "gemm"
    entry = _backend.Variant("Pallas GEMMs both ways (the fused-epilogue forward, the dx GEMM) with W "
                             "dequantised in-kernel: Int8Kernel / NF4Kernel weights never formed in full "
                             "precision, at the cost of speed")

    def forward(self, st, x, ops, ap, bp, m, bias, scale):
        kind, interpret = st.kind, self.interpret
        n, g = column_norm_scale(ops, kind, ap, bp, scale, m, interpret, st.config)
        xa = _xa(x, ap)

        def fwd(x, *a):  # sharded: tokens and output features split; K and the rank gathered
            ops_, (xa_, bp_, g_, scale_, *bias_) = a[:len(ops)], a[len(ops):]
            return kernel_gemm.forward_gemm(x, ops_, kind, xa_, bp_, g_, scale_, bias_[0] if bias_ else None,
                                            interpret=interpret, config=st.config.forward)

        rule = "m k, {w}, m r, r n, n, " + ("" if bias is None else ", n") + " -> m n"
        y = _shard(fwd, kind, rule, replicated=("k", "r"))(x, *ops, xa, bp, g, scale,
                                                            *(() if bias is None else (bias,)))
        return y, (n, g, xa, (None, None))

    def dx(self, st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished):
        kind = st.kind
        gw = g * ops[1] if kind == "int8" else g

        def bwd_dx(dy, gw, *a):  # sharded: tokens and input features split; N and the rank gathered
            return kernel_gemm.backward_dx(dy, gw, a[:-2], kind, *a[-2:], interpret=self.interpret,
                                           config=st.config.dx)

        return _shard(bwd_dx, kind, "m n, n, {w}, m r, k r -> m k", replicated=("n", "r"))(dy, gw, *ops, us, ap)


def _cublas_dx(st, interpret, ops, ap, bp, g, scale, dy, us, wm):
    """"merged" and "epilogue": dx = (dy g) (W + s A B)^T on cuBLAS. With many tokens one GEMM on the merged weight
    (W + s A B) g (one Pallas pass over W, and no float32 (M, in) partial results; "merged" may have kept it); with
    few tokens g goes on dy and the low-rank term is a second, small GEMM."""
    dt = dy.dtype
    fin_, fout_ = ap.shape[0], bp.shape[1]
    if wm is not None:
        return jnp.dot(dy, wm.T)
    if st.kind != "dense" or dy.shape[0] * (fout_ + 3.5 * fin_) >= fin_ * fout_:
        return jnp.dot(dy, _merged_weight(st.kind, ops, ap, bp, g, scale, interpret, st.config).T)
    w = ops[0].astype(dt)
    dx = jnp.dot((dy.astype(jnp.float32) * g[None, :]).astype(dt), w.T, preferred_element_type=jnp.float32)
    return (dx + jnp.dot(us, ap.T, preferred_element_type=jnp.float32)).astype(dt)


XLA = Xla()
SM90, MERGED, EPILOGUE, SM90_DEQUANT, GEMM = Sm90(), Merged(), Epilogue(), Sm90Dequant(), Gemm()
PALLAS: dict[str, Implementation] = {impl.variant: impl for impl in (SM90, MERGED, EPILOGUE, SM90_DEQUANT, GEMM)}
INTERPRET: dict[str, Implementation] = {variant: type(impl)(interpret=True) for variant, impl in PALLAS.items()}
# implementation="pallas:<variant>": the Pallas path's variants, as `_backend.resolve_implementation` checks them.
VARIANTS = {impl.name: impl.entry for impl in PALLAS.values() if impl.entry is not None}  # each has one


def choose(args: DoraArgs, device: _tuning.Device, interpret: bool = False) -> Implementation:
    """The implementation plain "pallas" (`interpret`: "interpret") runs. Where "sm90" could run a dense layer with
    some of its candidate tiles (`Sm90.tunable`), the tuned entry at the layer's shape decides where there is a
    valid one (`_tuning.choice` of `kernel_sm90.LAYER_OP`: "sm90" with its tiles, or a cuBLAS variant); elsewhere,
    and without one, `default_choice`. A pure function of the shapes, the dtype, the device and the tuning files."""
    rule = default_choice(args, device, interpret)
    if interpret or not SM90.tunable(args, device):
        return rule
    if kernel_sm90.tuned_tiles(args.tokens, args.fin, args.fout, args.padded_rank, args.dtype) is not None:
        return SM90
    entry = _tuning.choice(kernel_sm90.LAYER_OP, args.layer_key)  # the entry tuned_tiles read: not "sm90"'s
    named = {impl.name: impl for impl in (MERGED, EPILOGUE)}
    return named.get(entry["config"].get("impl"), rule) if entry is not None else rule


def default_choice(args: DoraArgs, device: _tuning.Device, interpret: bool = False) -> Implementation:
    """The rule plain "pallas" (`interpret`: "interpret") follows without a tuned entry.

    Int8Kernel weights take "sm90_dequant" where it runs (one Hopper GPU, 16-bit, tile-multiple shapes): W is never
    formed in full precision. Other quantised weights take "merged" on a GPU: a transient merged weight per layer
    and cuBLAS, as a dequantise-then-GEMM baseline holds one: "gemm", which dequantises inside Triton GEMMs (a
    codebook lookup per weight and GEMM tile), is several times slower (docs/performance.md, "DoRA and QDoRA").
    Interpreted, they take "gemm", whose kernels are the quantised paths' own
    (Mosaic GPU's interpreter runs "sm90_dequant" by name). Every dense variant reads W once for the column norm;
    beyond that and the base GEMM, "sm90" reads x once more (x A: 2 M K bytes), "merged" reads W and writes
    (W + s A B) g (4 K N bytes), "epilogue" reads x for x A and reads + writes x W (2 M K + 4 M N). So "sm90" runs
    wherever it can (one Hopper GPU, 16-bit, tile-multiple shapes; its Mosaic GPU GEMM ties cuBLAS) up to the tuned
    rank (`Sm90.tuned`: past it, the kernel's in-tile low-rank product costs more than "merged"'s weight pass), and
    elsewhere the cheaper of the other two. benchmarks/bench_dora.py measures every variant.
    """
    if args.kind != "dense":
        if interpret:
            return INTERPRET["gemm"]
        return SM90_DEQUANT if SM90_DEQUANT.supported(args, device) is None else MERGED
    if not interpret and SM90.tuned(args, device):
        return SM90
    return _cheaper_cublas(args, INTERPRET if interpret else PALLAS)


def _cheaper_cublas(args: DoraArgs, variants: dict[str, Implementation]) -> Implementation:
    """"merged" or "epilogue", whichever makes the smaller extra pass over memory (`default_choice`)."""
    merged_bytes, epilogue_bytes = 4 * args.fin * args.fout, 2 * args.tokens * args.fin + 4 * args.tokens * args.fout
    return variants["epilogue" if merged_bytes > epilogue_bytes else "merged"]


# ----------------------------------------------------------------------------------------------
# the custom_vjp and the kernels' launches every variant shares


def weight_ops(kernel, dtype):
    """(kind, operand tuple) for the kernels; dense weights are cast to the compute dtype."""
    if isinstance(kernel, Int8Kernel):
        return "int8", (kernel.q, kernel.scale.astype(jnp.float32))
    if isinstance(kernel, NF4Kernel):
        return "nf4", (kernel.packed, kernel.absmax.astype(jnp.float32))
    return "dense", (kernel.astype(dtype),)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


def pad_rank(lora_a, lora_b):
    """A and B with the rank padded with zeros to the kernels' (`pow2`)."""
    r = lora_a.shape[1]
    rp = pow2(r)
    return jnp.pad(lora_a, ((0, 0), (0, rp - r))), jnp.pad(lora_b, ((0, rp - r), (0, 0)))


def _shard(launch, kind, rule, replicated=(), summed=()):
    """`launch` run per shard under `rule`, where "{w}" stands for the weight operands (see _sharding).
    NF4 weights are not partitioned (packed layout): their kernels see gathered operands."""
    if kind == "nf4":
        return launch
    w = {"dense": "k n", "int8": "k n, n"}[kind]
    return _sharding.partitioned(launch, rule.format(w=w), replicated=replicated, summed=summed)


def _column_sumsq(ops, kind, ap, bp, scale, interpret, config):
    """Column sums of squares; sharded: output features split, the input axis summed per shard + psum."""
    def launch(*a):
        return kernel_norm.column_sumsq(a[:-3], kind, *a[-3:], interpret=interpret, config=config.norm)

    return _shard(launch, kind, "{w}, k r, r n, -> n", replicated=("r",), summed=("k",))(*ops, ap, bp, scale)


def column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config):
    """(n, g = m / n); on one device the fused kernel (one launch), sharded the partial sums + psum."""
    if jax.device_count() == 1:
        return kernel_norm.column_norm_scale(ops, kind, ap, bp, scale, m, interpret=interpret, config=config.norm)
    n = reference.floored_norm(_column_sumsq(ops, kind, ap, bp, scale, interpret, config))
    return n, m.astype(jnp.float32) / n


def _keeps_merged(config, kind) -> bool:
    """Whether "merged" keeps its merged weight for the backward: `config.save_merged`, where None means for a dense W
    only (a quantised W exists to save the memory that a kept full-precision copy per layer would take)."""
    return kind == "dense" if config.save_merged is None else config.save_merged


def _merged_weight(kind, ops, ap, bp, g, scale, interpret, config):
    """(W + s A B) * g in the compute dtype (K, N): one Pallas pass over W (QDoRA: a transient full-precision
    weight)."""

    def launch(*a):  # sharded: both weight axes split, the rank gathered
        ap_, bp_, g_, scale_ = a[-4:]
        return kernel_merge.merge_weight(a[:-4], kind, ap_, bp_, scale_, g=g_, interpret=interpret,
                                         config=config.merge)

    return _shard(launch, kind, "{w}, k r, r n, n, -> k n", replicated=("r",))(*ops, ap, bp, g, scale)


def _norm_and_merged_weight(kind, ops, ap, bp, scale, m, interpret, config):
    """(n, g, (W + s A B) * g, B g s or None). On one device two launches and no XLA op between them: the column
    norm's partial sums over row ranges, then the merge launch, which finishes g (and B g s) from them; sharded,
    the norm + psum, then the merge."""
    if jax.device_count() == 1:
        parts = kernel_norm.column_partials(ops, kind, ap, bp, scale, interpret=interpret, config=config.norm,
                                            rows=config.merge.norm_rows)
        wm, n, g, bg = kernel_merge.merge_weight(ops, kind, ap, bp, scale, partials=parts, magnitude=m,
                                                 interpret=interpret, config=config.merge)
        return n, g, wm, bg
    n, g = column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config)
    return n, g, _merged_weight(kind, ops, ap, bp, g, scale, interpret, config), None


def _xa(x, ap):
    return jnp.dot(x, ap)  # cuBLAS accumulates in float32 and rounds once to x's dtype


def _forward(st: _Layer, x, ops, a, b, m, bias, scale):
    ap, bp = pad_rank(a, b)
    y, (n, g, xa, saved) = st.impl.forward(st, x, ops, ap, bp, m, bias, scale)
    return y, (ap, bp, n, g, xa, saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dora_2d(st, x, ops, a, b, m, bias, scale):
    return _forward(st, x, ops, a, b, m, bias, scale)[0]


def _dora_2d_fwd(st, x, ops, a, b, m, bias, scale):
    y, (ap, bp, n, g, xa, (wm, bg)) = _forward(st, x, ops, a, b, m, bias, scale)
    return y, (x, ops, ap, bp, m, bias, scale, n, g, xa, y, wm, bg)


def _dora_2d_bwd(st, res, dy):
    kind, interpret, config, exact, rank, fin = st.kind, st.impl.interpret, st.config, st.exact, st.rank, st.fin
    x, ops, ap, bp, m, bias, scale, n, g, xa, y, wm, bg = res
    dt = x.dtype
    gs = g * scale
    # us = s (dy * g) B^T, with g folded into the tiny B instead of the big dy ("merged": the merge launch wrote
    # B g s).
    if bg is None:
        bg = (bp.astype(jnp.float32) * gs[None, :]).astype(dt)
    us = jnp.dot(dy, bg.T)  # cuBLAS rounds once to dt
    if xa is None:  # "merged" never formed x A in the forward
        xa = _xa(x, ap)
    dyg_scale = st.impl.dyg_scale(g, ops)
    finished = None
    if not exact and jax.device_count() == 1:
        # Unsharded, constant norm: the column launch returns the finished dB, dm and dbias (in-kernel when one
        # program covers every token), x^T us is rounded once by cuBLAS: no float32 intermediates left to cast.
        db_dt = jnp.float32 if bias is None else bias.dtype
        finished = kernel_columns.backward_columns(dy, y, xa, bias, interpret=interpret, config=config.columns,
                                                   finish=(gs, m, bp.dtype, m.dtype, db_dt), dyg_scale=dyg_scale)
    dx = st.impl.dx(st, x, ops, ap, bp, g, scale, dy, us, wm, dyg_scale, finished)
    if finished is not None:
        dbm, dm, db = finished[:3]
        dm = _dm_at_zero_magnitude(dm, dy, x, xa, ops, kind, bp, scale, n, m, fin)
        da = jnp.dot(x.T, us)
        return (dx, tuple(_zero_cotangent(o) for o in ops), da[:, :rank], dbm[:rank], dm,
                None if bias is None else db, jnp.zeros_like(scale))

    def bwd_cols(dy, y, xa, *bias_):  # sharded: output features split, tokens summed per shard + psum
        return kernel_columns.backward_columns(dy, y, xa, bias_[0] if bias_ else None, interpret=interpret,
                                               config=config.columns)

    rule = "m n, m n, m r" + ("" if bias is None else ", n") + " -> r n, n, n"
    p, dmz, db = _shard(bwd_cols, "dense", rule, replicated=("r",), summed=("m",))(
        dy, y, xa, *(() if bias is None else (bias,)))
    da = jnp.dot(x.T, us, preferred_element_type=jnp.float32)
    dbm = p * gs[None, :]
    # dm = sum_t dy z / n with z = x W + s (x A) B; since y - bias = z m / n, it is sum_t dy (y - bias) / m
    # from the saved output (no z kept). Undefined for a magnitude of exactly 0.
    dm = _dm_at_zero_magnitude(dmz / m.astype(jnp.float32), dy, x, xa, ops, kind, bp, scale, n, m, fin)
    if exact:
        # Through n: dL/dV = V * c, c = -g dm / n, V = W + s A B (V is never formed: two passes over W).
        c = -g * dm / n
        w = _dequant_ops(kind, ops, fin)
        a32, b32 = ap.astype(jnp.float32), bp.astype(jnp.float32)
        bc = b32 * c[None, :]
        da = da + scale * (w @ bc.T) + scale * scale * (a32 @ (bc @ b32.T))
        dbm = dbm + scale * (a32.T @ w) * c[None, :] + scale * scale * ((a32.T @ a32) @ bc)
    cot_ops = tuple(_zero_cotangent(o) for o in ops)
    dbias = None if bias is None else db.astype(bias.dtype)
    return (dx, cot_ops, da[:, :rank].astype(ap.dtype), dbm[:rank].astype(bp.dtype), dm.astype(m.dtype), dbias,
            jnp.zeros_like(scale))


def _dm_at_zero_magnitude(dm, dy, x, xa, ops, kind, bp, scale, n, m, fin):
    """dm = sum_t dy z / n, z = x W + s (x A) B. The kernels form it as sum_t dy (y - bias) / m, which is 0 / 0 for a
    magnitude of exactly 0 (where a zero column of W with B = 0 starts): such columns are recomputed from z, in a
    branch that runs only when some m is 0 (one more GEMM then)."""
    zero = m == 0

    def recompute(dm):
        z = (jnp.dot(x.astype(jnp.float32), _dequant_ops(kind, ops, fin))
             + scale * jnp.dot(xa.astype(jnp.float32), bp.astype(jnp.float32)))
        return jnp.where(zero, jnp.sum(dy.astype(jnp.float32) * z, axis=0) / n, dm).astype(dm.dtype)

    return jax.lax.cond(jnp.any(zero), recompute, lambda dm: dm, dm)


def _dequant_ops(kind, ops, fin):
    """W in float32 from kernel operands (only the exact-norm-gradient path needs it)."""
    if kind == "int8":
        return Int8Kernel(ops[0], ops[1]).dequantize()
    if kind == "nf4":
        return NF4Kernel(ops[0], ops[1], fin).dequantize()
    return ops[0].astype(jnp.float32)


_dora_2d.defvjp(_dora_2d_fwd, _dora_2d_bwd)


# ----------------------------------------------------------------------------------------------
# the tuner's view (pallas_fused/_tuning.py) of a dense layer's choice on Hopper: per layer shape
# (`kernel_sm90.layer_key`), the candidates as JSON ("sm90"'s tiles, a cuBLAS variant), a timed forward and backward


def layer_candidates(key: str) -> dict[str, dict]:
    """What the tuner times for the dense layer at shape `key`, as JSON, the rule's choice (`default_choice`) first:
    "sm90" with each of its candidate tiles (`Sm90.candidates`) and the cuBLAS variant the rule takes off sm90
    ("merged" or "epilogue", whichever makes the smaller extra pass over memory)."""
    tokens, fin, fout, rank, dtype, kind = kernel_sm90.parse_layer_key(key)
    args, device = DoraArgs.shaped(kind, tokens, fin, fout, rank, dtype), current_device()
    tiles = {name: t.to_json() for name, t in kernel_sm90.candidate_tiles(tokens, fin, fout, rank, dtype).items()}
    cublas = _cheaper_cublas(args, PALLAS)
    found = {cublas.variant: {"impl": cublas.name}}
    return {**tiles, **found} if default_choice(args, device) is SM90 else {**found, **tiles}


@functools.lru_cache(maxsize=1)  # the candidates of one shape are timed one after another, on the same operands
def layer_operands(key: str):
    """Distinct random operand sets (x, W, A, B, m, dy) of the layer at shape `key` that pass the 50 MB L2 together
    (at most 4), so that a call over them reads HBM as a training step's layers do; never zeros."""
    tokens, fin, fout, rank, dtype, _ = kernel_sm90.parse_layer_key(key)

    def operands(seed):
        kx, kw, ka, kb, km, kd = jax.random.split(jax.random.key(seed), 6)
        w = jax.random.normal(kw, (fin, fout), jnp.float32) / math.sqrt(fin)
        return (jax.random.normal(kx, (tokens, fin), dtype), w.astype(dtype),
                (jax.random.normal(ka, (fin, rank), jnp.float32) / math.sqrt(fin)).astype(dtype),
                (jax.random.normal(kb, (rank, fout), jnp.float32) / rank).astype(dtype),
                jax.random.uniform(km, (fout,), jnp.float32, 0.5, 2.0), jax.random.normal(kd, (tokens, fout), dtype))

    size = jnp.dtype(dtype).itemsize * (tokens * fin + fin * fout + 2 * tokens * fout)
    return [operands(seed) for seed in range(min(4, max(1, math.ceil(100e6 / size))))]


def layer_build(key: str, config: dict, interpret: bool = False):
    """A call running the layer's forward and backward (dx, dA, dB, dm: a fine-tune's step) at shape `key` with
    `config` (a candidate's JSON: a variant, "sm90"'s with its tiles) once on each of `layer_operands(key)`, in one
    jit, and the number of layers it runs. `interpret`: the variant in the Pallas interpreter (tests)."""
    sets = layer_operands(key)
    impl = (INTERPRET if interpret else PALLAS)[config["impl"].partition(":")[2]]
    layer_config = DEFAULT if config["impl"] != kernel_sm90.IMPL else dataclasses.replace(
        DEFAULT, sm90=kernel_sm90.LayerTiles.from_json(config))

    def step(x, w, a, b, m, dy):
        y, vjp = jax.vjp(lambda x, a, b, m: impl(DoraArgs(x, w, a, b, m, scale=2.0), layer_config), x, a, b, m)
        return vjp(dy)

    many = jax.jit(lambda sets: [step(*ops) for ops in sets])
    return (lambda: many(sets)), len(sets)


_tuning.register(kernel_sm90.LAYER_OP, _tuning.Tunable(candidates=layer_candidates, build=layer_build))
