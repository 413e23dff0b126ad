"""DoRA's per-shape choice under the autotuner (kernel_sm90.LAYER_OP): the lookup a layer makes on the sm90 path,
the candidates, and what a tuning cache's entry changes. The sm90 kernel cannot run on the CPU: its launches are
replaced by a stand-in that records the tiles it gets, so these test the selection, not the kernel."""

from __future__ import annotations

import contextlib
import functools
import json
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_fused import _backend, _sm90, _tuning
from pallas_fused.dora import dora_dense, impls, kernel_sm90, lora_dense
from pallas_fused.tune import ROUNDS, tune

S = jax.ShapeDtypeStruct
# (tokens, in, out, rank): square, few tokens (the rule's small tiles), the example's k/v and MLP projections (out
# 5504: no whole large tile, so "sm90" runs there only by a tuned entry), a rank past the tuned one, odd sizes
GRID = [(4096, 4096, 4096, 16), (512, 4096, 4096, 16), (16384, 2048, 512, 16), (16384, 2048, 5504, 16),
        (16384, 5504, 2048, 16), (4096, 4096, 11008, 64), (1024, 2048, 1024, 4), (256, 1024, 768, 8),
        (4000, 4096, 4096, 16), (512, 4096, 11008, 16)]  # the last: the rule's forward tile large, its dx's small


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty user cache dir of its own, every table read afresh, nothing traced before."""
    monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path))
    _tuning.reload()
    jax.clear_caches()
    yield tmp_path
    _tuning.set_cache_dir(None)
    _tuning.reload()
    jax.clear_caches()


@pytest.fixture
def launches(monkeypatch):
    """The sm90 GEMMs' launches as (m, n, k, rank, tile config), each returning zeros of its result's shape."""
    seen = []

    def matmul(a, b, *, b_layout, config, lowrank=None, out_dtype, **kw):
        m, k = a.shape
        n = b.shape[1] if b_layout == "kn" else b.shape[0]
        seen.append((m, n, k, 0 if lowrank is None else lowrank[0].shape[1], config))
        return jnp.zeros((m, n), out_dtype)

    monkeypatch.setattr(_sm90, "matmul", matmul)
    return seen


def layer_operands(tokens, fin, fout, rank, dtype=jnp.bfloat16):
    return S((tokens, fin), dtype), S((fin, fout), dtype), S((fin, rank), dtype), S((rank, fout), dtype), \
        S((fout,), jnp.float32)


def dora_step(x, w, a, b, m):
    """A DoRA layer's forward and backward (plain "pallas"), as a fine-tune's step runs it."""
    return jax.grad(lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=2.0, implementation="pallas").astype(
        jnp.float32).sum(), argnums=(0, 1, 2, 3))(x, a, b, m)


def write_entry(cache, key, name, config):
    path = cache / f"{_tuning.device_slug(_tuning.current_device().kind)}.json"
    path.write_text(json.dumps({"schema": _tuning.SCHEMA, "device_kind": _tuning.current_device().kind, "shapes": {
        kernel_sm90.LAYER_OP: {key: {"choice": name, "config": config, "ms": {name: 1.0}}}}}))
    _tuning.reload()
    jax.clear_caches()


def key_of(tokens, fin, fout, rank, dtype=jnp.bfloat16):
    return kernel_sm90.layer_key(tokens, fin, fout, rank, dtype)


def test_layer_key():
    key = key_of(16384, 2048, 5504, 16)
    assert key == "16384x2048x5504 r16 bfloat16 dense"
    assert kernel_sm90.parse_layer_key(key) == (16384, 2048, 5504, 16, jnp.dtype(jnp.bfloat16), "dense")
    assert impls.DoraArgs.shaped("dense", 16384, 2048, 5504, 12, jnp.bfloat16).layer_key == key  # the padded rank


def test_lookups_recorded_on_the_sm90_path():
    """A DoRA (and a LoRA) layer traced for a Hopper GPU looks up its shape, the MLP's too (some sm90 tile runs
    them); past the tuned rank, for fp32, off Hopper or interpreted it makes no lookup."""
    shapes = [(16384, 2048, 2048, 16), (16384, 2048, 512, 16), (16384, 2048, 5504, 16), (16384, 5504, 2048, 16)]
    with _backend.gpu_target((9, 0)), _tuning.recording() as seen:
        jax.eval_shape(lambda layers: [dora_step(*layer) for layer in layers],
                       [layer_operands(*shape) for shape in shapes])
    assert seen == [(kernel_sm90.LAYER_OP, key_of(*shape)) for shape in shapes]
    with _backend.gpu_target((9, 0)), _tuning.recording() as seen:
        x, w, a, b, _ = layer_operands(4096, 1024, 1024, 12)
        jax.eval_shape(lambda x, w, a, b: lora_dense(x, w, a, b, scale=2.0, implementation="pallas"), x, w, a, b)
    assert seen == [(kernel_sm90.LAYER_OP, key_of(4096, 1024, 1024, 16))]
    for cc, operands, impl in (((9, 0), layer_operands(4096, 4096, 4096, 64), "pallas"),
                               ((9, 0), layer_operands(4096, 4096, 4096, 16, jnp.float32), "pallas"),
                               ((8, 0), layer_operands(4096, 4096, 4096, 16), "pallas"),
                               ((9, 0), layer_operands(256, 256, 256, 16), "interpret")):
        with _backend.gpu_target(cc), _tuning.recording() as seen:
            x, w, a, b, m = operands
            jax.eval_shape(functools.partial(dora_dense, scale=2.0, implementation=impl), x, w, a, b, m)
        assert seen == [], (cc, impl)


@pytest.mark.parametrize("shape", GRID, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_candidates_are_valid(shape, dtype):
    """At most six candidates, the rule's choice first ("sm90" with its tiles where the rule runs sm90, else its
    cuBLAS variant), each named once; every tile pair one the kernel takes: whole tiles both ways and the ring beside
    the rank's low-rank slices within shared memory."""
    tokens, fin, fout, rank = shape
    key = key_of(*shape, dtype)
    with _backend.gpu_target((9, 0)):
        found = impls.layer_candidates(key)
        args, device = impls.DoraArgs.shaped("dense", *shape, dtype), impls.current_device()
        rule = impls.default_choice(args, device)
        rule_tiles = kernel_sm90.rule_tiles(tokens, fin, fout, rank)
    assert 1 <= len(found) <= 6 and len({json.dumps(c, sort_keys=True) for c in found.values()}) == len(found)
    first_name, first = next(iter(found.items()))
    if rule is impls.SM90:
        assert first_name == "sm90" and kernel_sm90.LayerTiles.from_json(first) == rule_tiles
    else:
        assert first == {"impl": rule.name}
    for name, config in found.items():
        if config["impl"] != kernel_sm90.IMPL:
            assert config == {"impl": impls.PALLAS[name].name}
            continue
        tiles = kernel_sm90.LayerTiles.from_json(config)
        assert tiles.to_json() == config and kernel_sm90.tiles_refuse(tiles, tokens, fin, fout, rank, dtype) is None
        for tile, (m, n, k) in ((tiles.forward, (tokens, fout, fin)), (tiles.dx, (tokens, fin, fout))):
            assert kernel_sm90.supported(m, n, k, dtype, tile) and tile.schedule == "cooperative"
            assert _sm90.smem_bytes(tile, 2, 2, 2, rank) <= _sm90.SMEM_LIMIT
    sm90_names = [n for n, c in found.items() if c["impl"] == kernel_sm90.IMPL]
    with _backend.gpu_target((9, 0)):
        assert bool(sm90_names) == bool(kernel_sm90.candidate_tiles(tokens, fin, fout, rank, dtype))


@pytest.mark.parametrize("shape", GRID, ids=lambda s: "x".join(map(str, s)))
def test_without_an_entry_todays_rule(shape, launches):
    """No cache: the variant is `default_choice`'s, and the sm90 GEMMs get `config_for`'s tiles (the forward's
    (tokens, in) x (in, out), dx's (tokens, out) x (out, in), at the padded rank): the choice before the tuner."""
    tokens, fin, fout, rank = shape
    padded = 1 << (rank - 1).bit_length() if rank > 16 else 16
    with _backend.gpu_target((9, 0)):
        args = impls.DoraArgs.shaped("dense", *shape, jnp.bfloat16)
        chosen = impls.choose(args, impls.current_device())
        assert chosen is impls.default_choice(args, impls.current_device())
        jax.eval_shape(dora_step, *layer_operands(*shape))
        expect = [(tokens, fout, fin, padded, kernel_sm90.config_for(tokens, fout, fin, padded)),
                  (tokens, fin, fout, padded, kernel_sm90.config_for(tokens, fin, fout, padded))]
    assert launches == (expect if chosen is impls.SM90 else [])


def test_an_entry_changes_the_tiles_and_the_variant(cache, launches):
    """A cache entry of "sm90" gives both GEMMs its tiles (LoRA's too); one of "merged" runs "merged" (no sm90
    launch); at the MLP's 5504 features, where the rule's tiles do not fit, an entry of "sm90" runs the kernel."""
    shape = (4096, 4096, 4096, 16)
    key = key_of(*shape)
    with _backend.gpu_target((9, 0)):
        found = impls.layer_candidates(key)
    assert found["sm90_256x128"] != found["sm90"]
    write_entry(cache, key, "sm90_256x128", found["sm90_256x128"])
    tiles = kernel_sm90.LayerTiles.from_json(found["sm90_256x128"])
    with _backend.gpu_target((9, 0)):
        jax.eval_shape(dora_step, *layer_operands(*shape))
        x, w, a, b, _ = layer_operands(*shape)
        jax.eval_shape(lambda x, w, a, b: jax.grad(lambda x, a, b: lora_dense(x, w, a, b, scale=2.0).astype(
            jnp.float32).sum(), argnums=(0, 1, 2))(x, a, b), x, w, a, b)
    assert [launch[-1] for launch in launches] == [tiles.forward, tiles.dx] * 2
    assert tiles.forward.wg_split == "m"

    launches.clear()
    write_entry(cache, key, "merged", {"impl": "pallas:merged"})
    with _backend.gpu_target((9, 0)):
        assert impls.choose(impls.DoraArgs.shaped("dense", *shape, jnp.bfloat16), impls.current_device()) \
            is impls.MERGED
        jax.eval_shape(dora_step, *layer_operands(*shape))
    assert launches == []

    mlp = (16384, 2048, 5504, 16)
    with _backend.gpu_target((9, 0)):
        args = impls.DoraArgs.shaped("dense", *mlp, jnp.bfloat16)
        assert impls.choose(args, impls.current_device()) is impls.MERGED  # the rule: no whole large tile
        small = impls.layer_candidates(key_of(*mlp))["sm90_small"]
    write_entry(cache, key_of(*mlp), "sm90_small", small)
    with _backend.gpu_target((9, 0)):
        assert impls.choose(args, impls.current_device()) is impls.SM90
        jax.eval_shape(dora_step, *layer_operands(*mlp))
    tiles = kernel_sm90.LayerTiles.from_json(small)
    assert launches == [(16384, 5504, 2048, 16, tiles.forward), (16384, 2048, 5504, 16, tiles.dx)]


@pytest.mark.parametrize("config,why", [
    ({"impl": "pallas:sm90", "forward": {"tile_m": 128}}, "expected {'impl'"),  # no dx
    ({"impl": "pallas:sm90", "forward": {"tile_q": 1}, "dx": {}}, "tile_q"),  # no such field
    ({"impl": "pallas:sm90", "forward": {"tile_m": 0}, "dx": {}}, "positive multiples of 64"),
    ({"impl": "pallas:sm90", "forward": {"tile_k": 96}, "dx": {}}, "positive multiples of 64"),  # the swizzle
    ({"impl": "pallas:sm90", "forward": {"tile_n": 192, "tile_k": 64, "max_concurrent_steps": 1}, "dx": {}},
     "not of whole tiles"),  # 4096 is no multiple of 384
    ({"impl": "pallas:sm90", "forward": {"max_concurrent_steps": 9}, "dx": {}}, "shared memory"),
    ({"impl": "pallas:sm90", "forward": {"schedule": "pingpong"}, "dx": {}}, "cooperative"),  # no low-rank step
    ({"forward": {}, "dx": {}}, "expected {'impl'"),  # no implementation named
    ({"impl": "pallas:gemm"}, None),  # not a choice of plain "pallas" here
    ({"impl": 3}, None),
], ids=["no_dx", "bad_field", "zero_tile", "tile_k_96", "not_whole_tiles", "smem", "pingpong", "no_impl", "gemm",
        "impl_not_a_name"])
def test_bad_entries_are_ignored(cache, launches, config, why):
    """An entry the kernel would refuse, or that names no variant plain "pallas" picks among: the rule, as without
    it, with a warning where it names "sm90"; never an error."""
    shape = (4096, 4096, 4096, 16)
    write_entry(cache, key_of(*shape), "bad", config)
    with _backend.gpu_target((9, 0)):
        with pytest.warns(RuntimeWarning, match="tuned DoRA tiles") if why else _no_warnings() as caught:
            assert impls.choose(impls.DoraArgs.shaped("dense", *shape, jnp.bfloat16), impls.current_device()) \
                is impls.SM90
            jax.eval_shape(dora_step, *layer_operands(*shape))
        rule = kernel_sm90.rule_tiles(*shape)
    if why:
        assert why in str(caught[0].message)
    assert [launch[-1] for launch in launches] == [rule.forward, rule.dx]


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_tune_round_trip(cache, launches):
    """`tune` over a DoRA step for a Hopper GPU times the layer's candidates (a fake timer), keeps the fastest in
    the cache, and the layer traced again runs it."""
    shape = (4096, 4096, 4096, 16)
    with _backend.gpu_target((9, 0)):
        found = impls.layer_candidates(key_of(*shape))
        times = {name: 2.0 for name in found} | {"sm90_256x128": 1.0}
        timed = []

        def timer(op, key, name, config):
            timed.append((op, key, name))
            assert config == found[name]
            return times[name]

        result = tune(dora_step, *layer_operands(*shape), timer=timer, progress=False)
        assert timed == [(kernel_sm90.LAYER_OP, key_of(*shape), name) for _ in range(ROUNDS) for name in found]
        assert result.entries[kernel_sm90.LAYER_OP][key_of(*shape)]["choice"] == "sm90_256x128"
        launches.clear()
        jax.eval_shape(dora_step, *layer_operands(*shape))
    tiles = kernel_sm90.LayerTiles.from_json(found["sm90_256x128"])
    assert [launch[-1] for launch in launches] == [tiles.forward, tiles.dx]


def test_command_line_ops():
    from pallas_fused.tune.__main__ import dora_layers, main

    assert dora_layers(2048, 512, 5504) == [(2048, 2048), (2048, 512), (2048, 5504), (5504, 2048)]
    for bad in (["--ops", "adam"], ["--dora-rank", "0"]):
        with pytest.raises(SystemExit, match=bad[0]):
            main(bad)


@pytest.mark.parametrize("name", ["sm90", "sm90_256x128", "merged"])
def test_build_runs_the_layer(name):
    """The tuner's call runs the layer's forward and backward with the candidate's config on each operand set: its
    gradients as XLA's reference gives them (in the Pallas interpreter; Mosaic GPU's needs jax >= 0.12)."""
    if name.startswith("sm90") and not _backend.has_mosaic_interpret():
        pytest.skip("Mosaic GPU's interpret mode needs jax >= 0.12")
    key = key_of(256, 128, 256, 16)
    with _backend.gpu_target((9, 0)):
        config = impls.layer_candidates(key)[name]
    call, ops = impls.layer_build(key, config, interpret=True)
    sets = impls.layer_operands(key)
    assert ops == len(sets) == 4
    got = call()
    for (x, w, a, b, m, dy), grads in zip(sets[:2], got[:2]):
        f32 = [v.astype(jnp.float32) for v in (x, a, b, m)]
        w32 = w.astype(jnp.float32)
        _, vjp = jax.vjp(lambda x, a, b, m, w32=w32: impls.XLA(impls.DoraArgs(x, w32, a, b, m, scale=2.0)), *f32)
        for g, e in zip(grads, vjp(dy.astype(jnp.float32))):
            scale = float(jnp.max(jnp.abs(e)))
            assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - e))) <= 3e-2 * scale, name
