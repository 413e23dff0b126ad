import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _backend, _devices, _jax_compat, _xla_workarounds
from tests.helpers import assert_close, rand, rel_err


def test_none_picks_reference_on_cpu():
    if _backend.gpu_device() is not None:
        assert _backend.resolve_implementation(None, op="x") == "pallas"
    else:
        assert _backend.resolve_implementation(None, op="x") == "xla"


def test_explicit_pallas_without_gpu_raises_naming_the_op():
    if _backend.gpu_device() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(_backend.ImplementationError, match="my_op: implementation='pallas' needs a CUDA GPU"):
        _backend.resolve_implementation("pallas", op="my_op")


@pytest.mark.parametrize("flags, passes", [
    ("", set()),
    ("--xla_disable_hlo_passes=reduce-decomposer", {"reduce-decomposer"}),
    ("--xla_gpu_autotune_level=0 --xla_disable_hlo_passes=a,reduce-decomposer", {"a", "reduce-decomposer"}),
    ("--xla_disable_hlo_passes=a --xla_disable_hlo_passes=b", {"a", "b"}),
    ("--xla_disable_hlo_passes='a,b'", {"a", "b"}),
    ("--xla_dump_hlo_pass_re=reduce-decomposer", set()),
])
def test_xla_disabled_passes_read_from_xla_flags(monkeypatch, flags, passes):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert _backend.xla_disabled_passes() == passes
    assert _backend.xla_disabled_passes(flags) == passes


@pytest.mark.parametrize("version, gpu, flags, warned", [
    ((0, 11, 2), True, "", False),
    ((0, 12, 0), True, "", True),
    ((0, 12, 0), True, "--xla_disable_hlo_passes=reduce-decomposer", False),
    ((0, 12, 0), False, "", False),
    ((0, 12, 1), True, "", False),  # measured right again
])
def test_xla_miscompile_warned_once_where_it_applies(monkeypatch, version, gpu, flags, warned):
    """On a GPU with an affected jax and the pass not disabled, the first op resolved warns once per process,
    naming the flag that avoids the miscompile; the defaults stay the kernels (XLA gets the model around them
    wrong as much)."""
    monkeypatch.setattr(_devices, "gpu_device", lambda: object() if gpu else None)
    monkeypatch.setattr(_devices, "compute_capability", lambda: (9, 0) if gpu else None)
    monkeypatch.setattr(_jax_compat, "JAX_VERSION", version)
    fresh = functools.cache(_xla_workarounds.warn_xla_miscompiles.__wrapped__)  # warns once per process: once here
    monkeypatch.setattr(_xla_workarounds, "warn_xla_miscompiles", fresh)
    monkeypatch.setenv("XLA_FLAGS", flags)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for op in ("lora_dense", "dora_dense", "rms_norm"):
            assert _backend.resolve_implementation(None, op=op) == ("pallas" if gpu else "xla")
            if gpu:
                assert _backend.resolve_implementation("pallas", op=op) == "pallas"
    messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    want = [m for m in _backend.XLA_GPU_MISCOMPILES if m.affects(version)] if warned else []
    assert len(messages) == len(want)
    for message, m in zip(messages, want):
        assert f"XLA_FLAGS=--xla_disable_hlo_passes={m.disable_pass}" in message and m.what in message
    assert _backend.xla_gpu_miscompiles() == tuple(want)


def test_unknown_implementation_raises():
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        _backend.resolve_implementation("cuda", op="my_op")


VARIANTS = {"pallas:fast": _backend.Variant("a Triton variant"),
            "pallas:hopper": _backend.Variant("a Mosaic GPU variant", needs=(9, 0), interpretable=False)}


def test_variants_resolve_and_interpret_spelling():
    """"interpret:<variant>" runs a Triton variant's kernels on the CPU; a Mosaic GPU one has no interpret form."""
    assert _backend.resolve_implementation("interpret:fast", op="x", variants=VARIANTS) == "interpret:fast"
    assert _backend.split_implementation("interpret:fast") == ("interpret", "fast")
    assert _backend.split_implementation("pallas") == ("pallas", None)
    with pytest.raises(ValueError, match="Mosaic GPU kernel, which the Pallas interpreter does not run"):
        _backend.resolve_implementation("interpret:hopper", op="x", variants=VARIANTS)
    if _backend.gpu_device() is None:
        with pytest.raises(_backend.ImplementationError, match="x: implementation='pallas:hopper' needs a CUDA GPU"):
            _backend.resolve_implementation("pallas:hopper", op="x", variants=VARIANTS)


def test_unknown_variant_lists_the_valid_names():
    names = "None, 'pallas', 'xla', 'interpret', 'pallas:fast', 'pallas:hopper', 'interpret:fast'"
    with pytest.raises(ValueError, match=f"my_op: implementation must be None or one of {names}, got 'pallas:slow'"):
        _backend.resolve_implementation("pallas:slow", op="my_op", variants=VARIANTS)
    with pytest.raises(ValueError, match="got 'pallas:fast'"):  # a variant of another op
        _backend.resolve_implementation("pallas:fast", op="my_op")
    assert _backend.valid_implementations(VARIANTS)[-1] == "interpret:fast"


def test_tuning_tables_load_and_fall_back():
    """Each device kind's table holds every entry the ops read, with their heuristic's fields; a GPU kind without a
    table (and the CPU) gets the heuristic."""
    from pallas_fused.adam import kernel as adam_kernel
    from pallas_fused.adam import kernel_mosaic
    from pallas_fused.dora import kernel_sm90
    from pallas_fused.fp8 import kernel as fp8_kernel
    from pallas_fused.fp8 import kernel_sm90 as fp8_sm90
    from pallas_fused.fp8 import kernel_sm90_quantize as fp8_sm90_quantize
    from pallas_fused.galore import kernel as galore_kernel

    assert _backend.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert _backend.tuning_table("A GPU nobody measured") == {}
    tables = sorted(_backend.TUNING_DIR.glob("*.json"))
    assert tables, "no tuning table ships with the package"
    for path in tables:
        table = _backend.tuning_table(path.stem.upper().replace("_", " "))
        assert _backend.device_slug(table["device_kind"]) == path.stem
        for section, heuristic in (("dora_sm90", kernel_sm90.HEURISTIC), ("adam_launch", adam_kernel.HEURISTIC),
                                   ("fp8_cast", fp8_kernel.HEURISTIC), ("adam_mosaic", kernel_mosaic.HEURISTIC),
                                   ("fp8_sm90", fp8_sm90.HEURISTIC), ("galore_up", galore_kernel.UP_HEURISTIC),
                                   ("galore_variant", galore_kernel.VARIANT_HEURISTIC),
                                   ("fp8_sm90_blockwise", fp8_sm90.BLOCKWISE_HEURISTIC),
                                   ("fp8_blockwise", fp8_kernel.BLOCKWISE_HEURISTIC),
                                   ("fp8_blockwise_sm90", fp8_sm90_quantize.HEURISTIC)):
            for key, fields in heuristic.items():
                if key in table.get(section, {}):
                    entry = table[section][key]
                    assert type(entry) is type(fields), (path.name, section, key)
                    if isinstance(fields, dict):
                        assert set(entry) == set(fields), (path.name, section, key)
    if _backend.gpu_device() is None:
        assert _backend.tuned("dora_sm90", {"large": 1}) == {"large": 1}
        assert kernel_sm90.tiles()[0].tile_k == kernel_sm90.HEURISTIC["large"]["tile_k"]
        assert adam_kernel.default_launch("q8").block == 256


def test_explicit_choices_pass_through():
    assert _backend.resolve_implementation("xla", op="x") == "xla"
    assert _backend.resolve_implementation("interpret", op="x") == "interpret"


def test_triton_call_masked_kernel_interpret():
    """The launcher runs a masked Triton-style kernel over a size that is not a multiple of the block."""
    def kernel(x_ref, o_ref):
        idx = jax.experimental.pallas.program_id(0) * 32 + jnp.arange(32)
        mask = idx < x_ref.shape[0]
        x = _backend.load(x_ref.at[idx], mask=mask, other=0.0)
        _backend.store(o_ref.at[idx], x * 3.0 - 1.0, mask=mask)

    x = rand(0, (101,))
    out = _backend.triton_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                               name="pallas_fused_test", interpret=True)(x)
    assert_close(out, np.asarray(x, np.float64) * 3 - 1, what="masked kernel")


def test_helpers_reject_nan_and_wrong_values():
    ref = np.ones(8)
    bad = jnp.ones(8).at[3].set(jnp.nan)
    assert rel_err(bad, ref) == float("inf")
    with pytest.raises(AssertionError):
        assert_close(bad, ref, what="nan")
    with pytest.raises(AssertionError):
        assert_close(jnp.ones(8) * 1.01, ref, what="off by 1%")


def test_version_parse():
    assert _jax_compat._parse_version("0.11.2") == (0, 11, 2)
    assert _jax_compat._parse_version("0.10.2.dev20260101") == (0, 10, 2)
    assert isinstance(_backend.JAX_011, bool)


def test_backend_owns_nothing():
    """`_backend` only re-exports (its docstring names each owner): a name defined there would be one the owning
    module's own functions never see, and every name it imports is exported."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(_backend.__file__).read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            imported.update(alias.asname or alias.name for alias in node.names)
        else:
            assert isinstance(node, ast.Expr | ast.Assign), ast.dump(node)[:80]  # the docstring, __all__
            assert isinstance(node, ast.Expr) or [t.id for t in node.targets] == ["__all__"]
    assert sorted(_backend.__all__) == sorted(imported)
