"""DoRA's implementation objects (dora/impls.py): what each one supports and why not, its candidates and default
config, plain "pallas"'s choice among them, and each interpretable one against the reference when called directly."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_fused import _backend
from pallas_fused.dora import impls, kernel_sm90, quantize_int8, quantize_nf4
from pallas_fused.dora.config import DEFAULT, Config
from tests.dora.test_dora import make, vjp_all
from tests.helpers import assert_close

HOPPER_LAYER = ("dense", 4096, 4096, 4096, 16, jnp.bfloat16)
ALL = (impls.XLA, *impls.PALLAS.values(), *impls.INTERPRET.values())


def reason(impl, *layer, cc=None):
    args = impls.DoraArgs.shaped(*layer)
    if cc is None:
        return impl.supported(args, impls.current_device())
    with _backend.gpu_target(cc):
        return impl.supported(args, impls.current_device())


def test_names_and_variants_table():
    assert [impl.name for impl in impls.PALLAS.values()] == list(impls.VARIANTS)
    assert impls.XLA.name == "xla"
    assert {impl.name for impl in impls.INTERPRET.values()} == {"interpret:" + n.partition(":")[2]
                                                                for n in impls.VARIANTS}


def test_sm90_reasons():
    sm90 = impls.PALLAS["sm90"]
    assert reason(sm90, *HOPPER_LAYER, cc=(9, 0)) is None
    assert "Hopper" in reason(sm90, *HOPPER_LAYER, cc=(8, 0))
    assert "Hopper" in reason(sm90, *HOPPER_LAYER)  # no GPU
    assert "dense 16-bit kernel" in reason(sm90, "int8", 4096, 4096, 4096, 16, jnp.bfloat16, cc=(9, 0))
    assert "16-bit x" in reason(sm90, "dense", 4096, 4096, 4096, 16, jnp.float32, cc=(9, 0))
    assert "multiples of the tile" in reason(sm90, "dense", 4000, 4096, 4096, 16, jnp.bfloat16, cc=(9, 0))
    interpreted = reason(impls.INTERPRET["sm90"], *HOPPER_LAYER)
    assert (interpreted is None) == _backend.has_mosaic_interpret()
    if interpreted is not None:
        assert "jax >= 0.12" in interpreted


def test_sm90_dequant_reasons():
    dq = impls.PALLAS["sm90_dequant"]
    layer = ("int8", 4096, 4096, 4096, 16, jnp.bfloat16)
    assert reason(dq, *layer, cc=(9, 0)) is None
    assert "Hopper" in reason(dq, *layer, cc=(8, 0))
    assert "needs an Int8Kernel, got an NF4Kernel" in reason(dq, "nf4", 4096, 4096, 4096, 16, jnp.bfloat16, cc=(9, 0))
    assert "needs an Int8Kernel, got a dense kernel" in reason(dq, *HOPPER_LAYER, cc=(9, 0))
    assert "multiples of its tiles" in reason(dq, "int8", 4096 + 128, 4096, 4096, 16, jnp.bfloat16, cc=(9, 0))
    assert "multiples of its tiles" in reason(dq, "int8", 4096, 4096, 4096, 16, jnp.float32, cc=(9, 0))


@pytest.mark.parametrize("kind", ["dense", "int8", "nf4"])
def test_portable_implementations_run_everything(kind):
    """XLA, "merged" and "gemm" take any weight on any device; "epilogue" a dense one only."""
    layer = (kind, 37, 45, 29, 5, jnp.float32)
    for impl in (impls.XLA, impls.PALLAS["merged"], impls.PALLAS["gemm"], impls.INTERPRET["merged"],
                 impls.INTERPRET["gemm"]):
        for cc in (None, (8, 0), (9, 0)):
            assert reason(impl, *layer, cc=cc) is None, (impl, cc)
    epilogue = reason(impls.PALLAS["epilogue"], *layer)
    assert epilogue is None if kind == "dense" else "dense kernel only" in epilogue


@pytest.mark.parametrize("impl", ALL, ids=lambda impl: impl.name)
def test_candidates_and_default_config(impl):
    """The default config is the rule (`dora.Config()`'s tiles, none for XLA; "sm90" with its rule's GEMM tiles: no
    tuning cache here), and the candidates start with it and are each a config the implementation takes."""
    args, device = impls.DoraArgs.shaped(*HOPPER_LAYER), impls.current_device()
    default = impl.default_config(args, device)
    if isinstance(impl, impls.Sm90):
        assert default.sm90 == kernel_sm90.rule_tiles(4096, 4096, 4096, 16)
        default = dataclasses.replace(default, sm90=None)
        assert len(impl.candidates(args, device)) > 1
    assert default == (None if impl is impls.XLA else DEFAULT)
    default = impl.default_config(args, device)
    found = impl.candidates(args, device)
    assert found and list(found.values())[0] == default
    for config in found.values():
        assert config is None if impl is impls.XLA else isinstance(config, Config)


def test_choose():
    """Plain "pallas" on Hopper: "sm90" up to the tuned rank, "sm90_dequant" for an Int8Kernel where it runs, else
    "merged" or "epilogue" by the bytes each adds; interpreted, never a Mosaic GPU kernel."""
    def chosen(*layer, interpret=False):
        return impls.choose(impls.DoraArgs.shaped(*layer), impls.current_device(), interpret).name

    with _backend.gpu_target((9, 0)):
        assert chosen(*HOPPER_LAYER) == "pallas:sm90"
        assert chosen("dense", 4096, 4096, 4096, kernel_sm90.max_rank() + 1, jnp.bfloat16) == "pallas:merged"
        assert chosen("dense", 512, 4096, 11008, 64, jnp.bfloat16) == "pallas:epilogue"
        assert chosen("int8", 4096, 4096, 4096, 16, jnp.bfloat16) == "pallas:sm90_dequant"
        assert chosen("nf4", 4096, 4096, 4096, 16, jnp.bfloat16) == "pallas:merged"
        assert chosen(*HOPPER_LAYER, interpret=True) == "interpret:merged"
        assert chosen("int8", 4096, 4096, 4096, 16, jnp.bfloat16, interpret=True) == "interpret:gemm"
    with _backend.gpu_target((8, 0)):
        assert chosen(*HOPPER_LAYER) == "pallas:merged"
        assert chosen("int8", 4096, 4096, 4096, 16, jnp.bfloat16) == "pallas:merged"


@pytest.mark.parametrize("cc", [None, (8, 0), (9, 0)])
def test_choice_is_supported(cc):
    """Whatever plain "pallas" picks runs the layer on that device."""
    with _backend.gpu_target(cc) if cc else contextlib.nullcontext():
        device = impls.current_device()
        for kind in ("dense", "int8", "nf4"):
            for tokens, fin, fout, rank in ((37, 45, 29, 5), (4096, 4096, 4096, 16), (4096, 4096, 11008, 64),
                                            (4000, 4096, 4096, 16), (512, 4096, 11008, 200)):
                for dtype in (jnp.bfloat16, jnp.float32):
                    args = impls.DoraArgs.shaped(kind, tokens, fin, fout, rank, dtype)
                    for interpret in (False, True):
                        impl = impls.choose(args, device, interpret)
                        assert impl.interpret == interpret and impl.supported(args, device) is None, (args, impl)


@pytest.mark.parametrize("variant,quantize", [("merged", None), ("epilogue", None), ("gemm", None),
                                              ("merged", quantize_int8), ("gemm", quantize_nf4)])
def test_interpret_object_against_reference(variant, quantize):
    """Each interpretable object called directly (its default config) on odd shapes: the forward and all five
    gradients as close to the float32 reference as XLA's same-dtype reference is."""
    x, w, a, b, m, bias, dy = make(600, (37,), 45, 29, 5, jnp.bfloat16, w_dtype=jnp.float32)
    kernel = quantize(w) if quantize else w.astype(jnp.bfloat16)
    impl, device = impls.INTERPRET[variant], impls.current_device()

    def layer(impl):
        def fn(x, a, b, m, bias):
            args = impls.DoraArgs(x, kernel, a.astype(x.dtype), b.astype(x.dtype), m, bias.astype(x.dtype), 0.5)
            assert impl.supported(args, device) is None
            return impl(args, impl.default_config(args, device))
        return fn

    w32 = (quantize(w).dequantize() if quantize else kernel).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        y_ex, g_ex = vjp_all(lambda x, a, b, m, bias: impls.XLA(impls.DoraArgs(x, w32, a, b, m, bias, 0.5)),
                             (x.astype(jnp.float32), a, b, m, bias), dy.astype(jnp.float32))
    y_base, g_base = vjp_all(layer(impls.XLA), (x, a, b, m, bias), dy)
    y, g = vjp_all(layer(impl), (x, a, b, m, bias), dy)
    assert_close(y, y_ex, baseline=y_base, dtype=jnp.bfloat16, what=f"{impl.name} y")
    for name, ours, base, ex in zip("x a b m bias".split(), g, g_base, g_ex):
        assert ours.dtype == base.dtype, name
        assert_close(ours, ex, baseline=base, dtype=jnp.bfloat16, what=f"{impl.name} d{name}")
