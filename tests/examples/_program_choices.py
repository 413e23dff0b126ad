"""Every implementation / variant / tuning choice pallas_fused makes on its own, for a fixed set of shapes.

The SPMD programs of a multi-process job must be identical: each choice must be a pure function of shapes,
dtypes and the device kind. test_multi_process.py compares this record across processes (and across host
states in one process); any choice that read a clock, a benchmark or host-local state would differ.
"""

from __future__ import annotations

import jax.numpy as jnp

SHAPES = [(64, 64), (256, 512), (512, 256), (2048, 2048), (2048, 5504), (5504, 2048), (4096, 11008), (100, 37)]
RANKS = (8, 32, 128)
TOKENS = (256, 16384)


def program_choices() -> dict:
    from pallas_fused import _backend
    from pallas_fused.dora import impls as dora_impls
    from pallas_fused.embed import api as embed_api
    from pallas_fused.embed import kernel as embed_kernel
    from pallas_fused.fp8 import Float8Config
    from pallas_fused.galore import kernel as galore_kernel
    from pallas_fused.norm import kernel as norm_kernel
    from pallas_fused.swiglu import kernel as swiglu_kernel

    record: dict = {"device": _backend.device_name(),
                    "implementation": _backend.resolve_implementation(None, op="choices")}
    record["galore_variant"] = {f"{m}x{n}/r{r}/{side}": galore_kernel.choose_variant((m, n), r, side)
                                for m, n in SHAPES for r in RANKS for side in ("left", "right")}
    device = dora_impls.current_device()
    record["dora_variant"] = {f"{t}x{fin}x{fout}/{dt}/{interp}": dora_impls.choose(
        dora_impls.DoraArgs.shaped("dense", t, fin, fout, 16, jnp.dtype(dt)), device, interp).variant
                           for t in TOKENS for fin, fout in SHAPES for dt in ("bfloat16", "float32")
                           for interp in (False, True)}
    from pallas_fused.adam import kernel as adam_kernel
    from pallas_fused.dora import kernel_sm90
    from pallas_fused.fp8 import kernel as fp8_kernel
    from pallas_fused.fp8 import kernel_sm90 as fp8_sm90

    record["dora_sm90_tiles"] = {f"{t}x{fin}x{fout}": repr(kernel_sm90.config_for(t, fout, fin))
                                 for t in TOKENS for fin, fout in SHAPES}
    record["adam_launch"] = {k: repr(adam_kernel.default_launch(k)) for k in ("fp32", "q8")}
    record["fp8_cast"] = {str(axis): fp8_kernel.cast_config(axis) for axis in (None, 0, 1)}
    record["fp8_recipes"] = {name: repr(Float8Config.from_recipe(name))
                             for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    record["fp8_sm90_config"] = {f"{m}x{n}x{k}": repr(fp8_sm90.config_for(m, n, k))
                                 for m, n in SHAPES for k in (64, 2048)}
    record["embed"] = {f"{t}x{v}x{d}/{dt}": (embed_api.use_onehot(v, jnp.dtype(dt)),
                                             repr(embed_kernel.choose_config(t, v, d)))
                       for t in TOKENS for v in (256, 1000, 32000) for d in (128, 2048)
                       for dt in ("bfloat16", "float32")}
    record["rms_norm"] = {f"{r}x{d}/{bwd}": repr(norm_kernel.choose_config(r, d, bwd))
                          for r in TOKENS for d in (100, 2048, 5504) for bwd in (False, True)}
    record["swiglu"] = {f"{r}x{f}/{bwd}": repr(swiglu_kernel.choose_config(r, f, bwd))
                        for r in TOKENS for f in (77, 5504, 11008) for bwd in (False, True)}
    return record
