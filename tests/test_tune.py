"""The tuning layers (pallas_fused/_tuning.py) and the autotuner (pallas_fused.tune), on the CPU: the user cache's
round trip and its bad files, the choice given timings, the budget, and the nearest shipped table."""

import json
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_fused import _backend, _tuning
from pallas_fused.fp8 import gemm, kernel_sm90
from pallas_fused.tune import ROUNDS, pick, tune

H200 = _tuning.describe("NVIDIA H200")
S = jax.ShapeDtypeStruct
# a toy tunable op: its candidates scale x, the first being its untuned choice
TOY = {"one": {"scale": 1.0}, "two": {"scale": 2.0}, "three": {"scale": 3.0}}


def toy(x):
    """x times the tuned candidate's scale at x's shape (the untuned one's where nothing is tuned)."""
    entry = _tuning.choice("toy", f"{x.shape[0]}x{x.shape[1]}")
    return x * (entry["config"] if entry else TOY["one"])["scale"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty user cache dir of its own, the toy op registered, every table read afresh."""
    monkeypatch.setenv(_tuning.CACHE_ENV, str(tmp_path))
    monkeypatch.setitem(_tuning.TUNABLES, "toy", _tuning.Tunable(candidates=lambda key: TOY, build=None))
    _tuning.reload()
    yield tmp_path
    _tuning.set_cache_dir(None)
    _tuning.reload()


def fake_timer(times, calls=None):
    """A timer giving times[candidate] (or times[key][candidate]) without running anything."""
    def timer(op, key, name, config):
        if calls is not None:
            calls.append((key, name))
        return times[key][name] if key in times else times[name]
    return timer


def as_h200(monkeypatch):
    """This process described as an H200 (its lookups read the H200's tables)."""
    monkeypatch.setattr(_tuning, "current_device", lambda: H200)
    _tuning.reload()


def write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_round_trip(cache):
    """tune records the toy op's two shapes, keeps the fastest candidate of each in this device's cache file, and
    the function then runs them; a fresh read of the file (a new process) gives the same choices."""
    x, y = jnp.ones((4, 3)), jnp.ones((2, 5))
    fn = jax.jit(lambda x, y: (toy(x), toy(y)))
    assert [float(v[0, 0]) for v in fn(x, y)] == [1.0, 1.0]
    times = {"4x3": {"one": 3.0, "two": 1.0, "three": 2.0}, "2x5": {"one": 1.0, "two": 3.0, "three": 0.5}}
    result = tune(fn, S((4, 3), jnp.float32), S((2, 5), jnp.float32), timer=fake_timer(times), progress=False)
    assert result.recorded == [("toy", "4x3"), ("toy", "2x5")]
    assert result.path == cache / f"{_tuning.device_slug(_tuning.current_device().kind)}.json"
    data = json.loads(result.path.read_text())
    assert data["schema"] == _tuning.SCHEMA and data["written_by"] == "pallas_fused.tune"
    assert data["shapes"]["toy"]["4x3"] == {"choice": "two", "config": TOY["two"], "ms": times["4x3"]}
    assert data["shapes"]["toy"]["2x5"]["choice"] == "three"
    assert [float(v[0, 0]) for v in fn(x, y)] == [2.0, 3.0]  # the jitted function traced again, tuned
    _tuning.reload()
    assert _tuning.choice("toy", "4x3")["choice"] == "two"
    assert "4x3" in result.table() and "3.00x" in result.table()  # the untuned 3.0 ms against 1.0


def test_cache_dir_argument_and_merge(cache, tmp_path_factory):
    """cache_dir= writes there and this process reads it from then on; tuning another shape keeps the file's
    other entries."""
    other = tmp_path_factory.mktemp("other")
    tune(toy, S((4, 3), jnp.float32), timer=fake_timer({"one": 2.0, "two": 1.0, "three": 3.0}), cache_dir=other,
         progress=False)
    assert _tuning.cache_dir() == other and not list(cache.glob("*.json"))
    result = tune(toy, S((8, 8), jnp.float32), timer=fake_timer({"one": 2.0, "two": 3.0, "three": 1.0}),
                  cache_dir=other, progress=False)
    assert set(json.loads(result.path.read_text())["shapes"]["toy"]) == {"4x3", "8x8"}
    assert float(toy(jnp.ones((4, 3)))[0, 0]) == 2.0 and float(toy(jnp.ones((8, 8)))[0, 0]) == 3.0


def test_choice_is_deterministic_ties_keep_the_earlier():
    """The fastest wins; on a tie the earlier candidate (the untuned choice first); a failed one never."""
    assert pick({"one": 1.0, "two": 1.0, "three": 2.0}) == "one"
    assert pick({"one": 2.0, "two": 1.0, "three": 1.0}) == "two"
    assert pick({"one": None, "two": 5.0}) == "two"
    assert pick({"one": None}) is None


def test_same_timings_give_the_same_file(cache, tmp_path_factory):
    """Two tunings with the same timings (one with a tie) write identical files, apart from nothing."""
    texts = []
    for _ in range(2):
        directory = tmp_path_factory.mktemp("run")
        result = tune(toy, S((4, 3), jnp.float32), timer=fake_timer({"one": 2.0, "two": 1.0, "three": 1.0}),
                      cache_dir=directory, progress=False)
        texts.append(result.path.read_text())
        assert result.entries["toy"]["4x3"]["choice"] == "two"
    assert texts[0] == texts[1]


def test_failed_candidate_is_not_chosen(cache):
    def timer(op, key, name, config):
        if name == "two":
            raise RuntimeError("does not fit in shared memory")
        return {"one": 2.0, "three": 3.0}[name]

    result = tune(toy, S((4, 3), jnp.float32), timer=timer, progress=False)
    assert result.entries["toy"]["4x3"] == {"choice": "one", "config": TOY["one"],
                                            "ms": {"one": 2.0, "two": None, "three": 3.0}}


def test_budget_leaves_the_rest_untimed(cache, capsys):
    """Once budget_s is spent no further candidate starts: 2.5 s at 1 s per candidate times three of six; the
    shape half timed keeps the fastest of those timed, its untuned choice among them; plain progress lines."""
    now, calls = [0.0], []

    def timer(op, key, name, config):
        calls.append((key, name))
        now[0] += 1.0
        return {"one": 2.0, "two": 1.0, "three": 0.5}[name]

    result = tune(lambda x, y: (toy(x), toy(y)), S((4, 3), jnp.float32), S((2, 2), jnp.float32), budget_s=2.5,
                  timer=timer, clock=lambda: now[0], progress=True)
    assert calls == [("4x3", "one"), ("4x3", "two"), ("4x3", "three")]
    assert result.untimed == 3 and set(result.entries["toy"]) == {"4x3"}
    with pytest.raises(ValueError, match="budget_s"):
        tune(toy, S((4, 3), jnp.float32), budget_s=0)
    now[0], calls[:] = 0.0, []  # 4x3's three rounds (9 s), then 2x2's first round cut after two candidates
    result = tune(lambda x, y: (toy(x), toy(y)), S((4, 3), jnp.float32), S((2, 2), jnp.float32), budget_s=10.5,
                  timer=timer, clock=lambda: now[0], progress=True)
    assert calls == [("4x3", name) for _ in range(ROUNDS) for name in ("one", "two", "three")] + [
        ("2x2", "one"), ("2x2", "two")]
    assert result.entries["toy"]["2x2"] == {"choice": "two", "config": TOY["two"], "ms": {"one": 2.0, "two": 1.0}}
    err = capsys.readouterr().err
    assert "toy 2x2 two: 1.0000 ms" in err or "pallas_fused.tune" in err  # a plain line, or tqdm's bar


def test_rounds_take_the_candidates_in_turn_and_keep_the_median(cache):
    """Each candidate is timed in ROUNDS rounds, the shape's candidates in turn; its time is the median over them,
    so one round run at clocks the others did not get (the first, after the idle of a compile) does not choose; a
    candidate that fails is not timed again."""
    assert ROUNDS == 3
    calls = []
    times = {"one": [0.5, 2.0, 2.1], "two": [1.2, 1.1, 1.0]}  # "one" fast only when timed first

    def timer(op, key, name, config):
        calls.append(name)
        if name == "three":
            raise RuntimeError("does not fit in shared memory")
        return times[name][sum(c == name for c in calls) - 1]

    result = tune(toy, S((4, 3), jnp.float32), timer=timer, progress=False)
    assert calls == ["one", "two", "three", "one", "two", "one", "two"]
    assert result.entries["toy"]["4x3"] == {"choice": "two", "config": TOY["two"],
                                            "ms": {"one": 2.0, "two": 1.1, "three": None}}


def test_without_a_gpu_nothing_is_timed(cache):
    if _backend.gpu_device() is not None:
        pytest.skip("a GPU is present")
    with pytest.warns(RuntimeWarning, match="no GPU"):
        result = tune(toy, S((4, 3), jnp.float32), progress=False)
    assert result.recorded == [("toy", "4x3")] and result.entries == {} and result.path is None


def test_cache_is_read_before_the_shipped_table(cache, monkeypatch):
    """An H200's lookups: a section's keys from the cache over the shipped table's (the others kept), a shape's
    choice from the cache, which the FP8 GEMM then takes over its rule."""
    as_h200(monkeypatch)
    shipped = _tuning.tuning_table("NVIDIA H200")["fp8_sm90"]
    assert _backend.tuned("fp8_sm90", kernel_sm90.HEURISTIC)["xla_min_k"] == shipped["xla_min_k"] == 8192
    key = gemm.gemm_key(16384, 2048, 5504, jnp.float8_e4m3fn, jnp.bfloat16, True, True)
    a, bt, sa, sb = S((16384, 2048), jnp.float8_e4m3fn), S((5504, 2048), jnp.float8_e4m3fn), S((16384,), jnp.float32), \
        S((5504,), jnp.float32)
    args = gemm.GemmArgs(a, bt, sa, sb, jnp.bfloat16)
    assert gemm.choose(args, H200) == (gemm.SM90, None)  # the rule
    write(cache / "nvidia_h200.json", {
        "schema": _tuning.SCHEMA, "device_kind": "NVIDIA H200", "fp8_sm90": {"xla_min_k": 4096},
        "shapes": {"fp8_gemm": {key: {"choice": "xla", "config": {"impl": "xla"}, "ms": {"sm90": 2.0, "xla": 1.0}}}}})
    _tuning.reload()
    table = _backend.tuned("fp8_sm90", kernel_sm90.HEURISTIC)
    assert table["xla_min_k"] == 4096 and table["tall_pingpong"] == shipped["tall_pingpong"]
    assert gemm.choose(args, H200) == (gemm.XLA, None)
    with _backend.gpu_target((9, 0)):
        tile = gemm.gemm_candidates(key)["sm90_pingpong"]  # the rule's tile here is the table's 6-stage ping-pong
    write(cache / "nvidia_h200.json", {"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H200", "shapes": {
        "fp8_gemm": {key: {"choice": "sm90_pingpong", "config": tile, "ms": {"sm90_pingpong": 1.0}}}}})
    _tuning.reload()
    impl, config = gemm.choose(args, H200)
    assert (impl, config.schedule, config.max_concurrent_steps) == (gemm.SM90, "pingpong", 4)


@pytest.mark.parametrize("text,why", [
    ("{not json", "not JSON"),
    ('["a", "list"]', "a JSON object was expected"),
    (json.dumps({"schema": _tuning.SCHEMA + 1, "device_kind": "NVIDIA H200"}), "schema version 2"),
    (json.dumps({"device_kind": "NVIDIA H200", "fp8_sm90": {}}), "schema version None"),
    (json.dumps({"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H100 80GB HBM3", "fp8_sm90": {"xla_min_k": 1}}),
     "table of 'NVIDIA H100 80GB HBM3', not of 'NVIDIA H200'"),
    (json.dumps({"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H200", "fp8_sm90": 3}), "section 'fp8_sm90'"),
    (json.dumps({"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H200", "shapes": {"toy": {"4x3": {"x": 1}}}}),
     "shapes.toy"),
], ids=["corrupt", "not_an_object", "schema_newer", "schema_missing", "foreign_device", "bad_section", "bad_shape"])
def test_bad_cache_file_is_ignored_with_one_warning(cache, monkeypatch, text, why):
    """A cache file that is not a table of this device kind and schema: one warning naming the file and why, then
    the shipped table, as without it; never an error."""
    as_h200(monkeypatch)
    write(cache / "nvidia_h200.json", text)
    with pytest.warns(RuntimeWarning, match="nvidia_h200.json ignored") as caught:
        table = _backend.tuned("fp8_sm90", kernel_sm90.HEURISTIC)
    assert why in str(caught[0].message) and len(caught) == 1
    assert table == {**kernel_sm90.HEURISTIC, **_tuning.tuning_table("NVIDIA H200")["fp8_sm90"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read once per process: no second warning
        assert _backend.tuned("fp8_sm90", kernel_sm90.HEURISTIC) == table
        assert _tuning.choice("toy", "4x3") is None


def test_tune_replaces_a_bad_cache_file(cache):
    path = cache / f"{_tuning.device_slug(_tuning.current_device().kind)}.json"
    write(path, "{not json")
    with pytest.warns(RuntimeWarning, match="not JSON"):
        assert _tuning.choice("toy", "4x3") is None
    result = tune(toy, S((4, 3), jnp.float32), timer=fake_timer({"one": 2.0, "two": 1.0, "three": 3.0}),
                  progress=False)
    assert result.path == path and json.loads(path.read_text())["shapes"]["toy"]["4x3"]["choice"] == "two"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


H100 = _tuning.describe("NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("kind,cc,sms,nearest", [
    ("NVIDIA H800", None, None, "NVIDIA H100 80GB HBM3"),  # 132 SMs, 3.35 TB/s: the H100 SXM's twin
    ("NVIDIA H100 PCIe", None, None, "NVIDIA H100 80GB HBM3"),  # 114 SMs, 2.0 TB/s
    ("NVIDIA GH200 480GB", None, None, "NVIDIA H100 80GB HBM3"),  # 132 SMs, 4.0 TB/s: nearer 3.35 than 4.8
    ("NVIDIA GH200 144G HBM3e", None, None, "NVIDIA H200"),  # 132 SMs, 4.9 TB/s
    ("NVIDIA H20", None, None, "NVIDIA H100 80GB HBM3"),  # 78 SMs, 4.0 TB/s
    ("NVIDIA H200 NVL", None, None, "NVIDIA H200"),
    ("NVIDIA H999", (9, 0), 140, "NVIDIA H100 80GB HBM3"),  # unknown: by SM count, a tie broken by name
    ("NVIDIA A100-SXM4-80GB", None, None, None),  # another architecture: no table of its own kind
    ("cpu", None, None, None),
])
def test_nearest_table(kind, cc, sms, nearest):
    """An sm90 device without a table takes the nearest table of its architecture by SM count and bandwidth."""
    device = _tuning.describe(kind, cc, sms)
    found = _tuning.nearest(device, [H100, H200])
    assert (found.kind if found else None) == nearest
    if kind == "NVIDIA H999":
        assert (device.num_sms, device.hbm_tbps) == (140, None)


def test_nearest_shipped_table_stands_in(tmp_path, monkeypatch):
    """With only the H200's table shipped, an H800 reads it (sections and shapes); once an H100 table is dropped in
    (one written by the tuner: shapes only), the H800 reads that one's shapes and the H100 keeps its own shapes,
    taking the launch sections it lacks from the H200's."""
    shipped = tmp_path / "tuning"
    shipped.mkdir()
    (shipped / "nvidia_h200.json").write_text((_tuning.TUNING_DIR / "nvidia_h200.json").read_text())
    monkeypatch.setattr(_tuning, "TUNING_DIR", shipped)
    _tuning.reload()
    h800, empty = _tuning.describe("NVIDIA H800"), tmp_path / "cache"
    h200_table = _tuning.tuning_table("NVIDIA H200")
    assert _tuning.layers(h800, empty) == ((h200_table,), (h200_table,))
    assert _tuning.layers(H200, empty) == ((h200_table,), (h200_table,))
    h100 = {"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0],
            "num_sms": 132, "shapes": {"toy": {"4x3": {"choice": "two", "config": TOY["two"], "ms": {"two": 1.0}}}}}
    write(shipped / "nvidia_h100_80gb_hbm3.json", h100)
    _tuning.reload()
    h100_table = _tuning.tuning_table("NVIDIA H100 80GB HBM3")
    assert h100_table == h100
    assert _tuning.layers(h800, empty) == ((h100_table,), (h100_table,))
    assert _tuning.layers(H100, empty) == ((h100_table, h200_table), (h100_table,))
    assert _tuning.layers(H200, empty) == ((h200_table, h100_table), (h200_table,))
    monkeypatch.setattr(_tuning, "current_device", lambda: H100)
    assert _backend.tuned("fp8_sm90", {})["tall_pingpong"] == h200_table["fp8_sm90"]["tall_pingpong"]
    _tuning.reload()


def test_shipped_tables_are_data():
    """Every shipped table is a valid table of its file's device kind, of an sm90 architecture with its SM count,
    and holds data only: no prose (the reasons live in docs/performance.md's "Tuning tables")."""
    for path in sorted(_tuning.TUNING_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        assert _tuning.check_table(data, data["device_kind"]) is None, path.name
        assert _tuning.device_slug(data["device_kind"]) == path.stem
        assert tuple(data["compute_capability"]) == (9, 0) and data["num_sms"] > 0

        def strings(value):
            if isinstance(value, dict):
                return [s for k, v in value.items() for s in [k, *strings(v)]]
            return [s for v in value for s in strings(v)] if isinstance(value, list) else \
                [value] if isinstance(value, str) else []
        assert "note" not in strings(data), path.name
        assert max(map(len, strings(data))) < 80, path.name  # names and shape keys, not sentences


def test_gemm_candidates_and_keys():
    """The FP8 GEMM's key names its shape, dtypes and scales; its candidates start with the rule's choice, each
    config once, every tile fitting shared memory for the output dtype."""
    from pallas_fused import _sm90

    key = gemm.gemm_key(16384, 2048, 5504, jnp.float8_e4m3fn, jnp.float32, True, False)
    assert key == "16384x2048x5504 float8_e4m3fn float32 rowwise,tensorwise"
    args = gemm.args_of_key(key)
    assert (args.m, args.k, args.n, args.a.dtype, args.bt.dtype, args.out_dtype, args.sa.shape, args.sb.shape) == (
        16384, 2048, 5504, jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float32, (16384,), ())
    assert args.key == key and args.fast_accum
    with _backend.gpu_target((9, 0)):  # 132 SMs
        found = gemm.gemm_candidates(key)
    assert list(found)[:2] == ["sm90", "xla"] and "sm90_pingpong_s6" in found
    assert len({json.dumps(c, sort_keys=True) for c in found.values()}) == len(found)
    for config in found.values():
        if config["impl"] == "pallas:sm90":
            assert _sm90.smem_bytes(_sm90.TileConfig(**config["tile"]), 1, 1, 4) <= _sm90.SMEM_LIMIT
    with _backend.gpu_target((9, 0)):  # 132 SMs
        wide = gemm.gemm_candidates(gemm.gemm_key(2048, 16384, 512, jnp.float8_e4m3fn, jnp.bfloat16, True, True))
    assert list(wide)[0] == "xla"  # cublas_wins there


def test_fp8_lookups_are_recorded_under_a_hopper_target():
    """A function of FP8 GEMMs traced for a Hopper GPU records one lookup per GEMM shape and scale form (the CLI's
    shapes: examples/train_llama.py's GPU preset)."""
    from pallas_fused import fp8
    from pallas_fused.tune.__main__ import model_shapes

    shapes = model_shapes(16384, 2048, 512, 5504)
    assert len(shapes) == 9 and (2048, 16384, 5504) in shapes and (16384, 512, 2048) in shapes
    e4 = jnp.float8_e4m3fn
    operands = [(S((m, k), e4), S((n, k), e4), S((m, 1), jnp.float32), S((), jnp.float32)) for m, k, n in shapes]
    with _backend.gpu_target((9, 0)), _tuning.recording() as seen:
        jax.eval_shape(lambda ops: [fp8.scaled_matmul_nt(*o) for o in ops], operands)
    assert seen == [("fp8_gemm", gemm.gemm_key(m, k, n, e4, jnp.bfloat16, True, False)) for m, k, n in shapes]


@pytest.mark.parametrize("choice", ["rule", "xla", "sm90_pingpong"])
def test_tuned_gemm_lowers(cache, monkeypatch, choice):
    """scaled_matmul_nt exported for a Hopper GPU runs the cache's choice at its shape: XLA's fp8 dot (no Mosaic GPU
    kernel), or the kernel with the tuned tile, or without an entry the rule's kernel."""
    import re

    from jax import export

    from pallas_fused import fp8

    as_h200(monkeypatch)
    m, k, n = 512, 256, 384
    key = gemm.gemm_key(m, k, n, jnp.float8_e4m3fn, jnp.bfloat16, True, True)
    if choice != "rule":
        with _backend.gpu_target((9, 0)):
            config = gemm.gemm_candidates(key)[choice]
        write(cache / "nvidia_h200.json", {"schema": _tuning.SCHEMA, "device_kind": "NVIDIA H200", "shapes": {
            "fp8_gemm": {key: {"choice": choice, "config": config, "ms": {choice: 1.0}}}}})
        _tuning.reload()
    args = (jnp.ones((m, k), jnp.float8_e4m3fn), jnp.ones((n, k), jnp.float8_e4m3fn), jnp.ones((m, 1)),
            jnp.ones((n, 1)))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in ("mosaic_gpu", "mosaic_gpu_v2")]
    jax.clear_caches()  # traced by another case with another cache: traced again (as `tune` does after writing)
    with _backend.gpu_target((9, 0)), _tuning.recording() as seen:
        module = export.export(jax.jit(fp8.scaled_matmul_nt), platforms=["cuda"], disabled_checks=checks)(
            *args).mlir_module()
    assert seen == [("fp8_gemm", key)]
    assert len(re.findall(r"custom_call @mosaic_gpu", module)) == (0 if choice == "xla" else 1)


def test_cooperative_candidate_beside_the_tables_pingpong(cache, monkeypatch):
    """Where the H200's table gives a tall GEMM the ping-pong tile, the tuner times the cooperative tile too."""
    as_h200(monkeypatch)
    with _backend.gpu_target((9, 0)):
        found = gemm.gemm_candidates(gemm.gemm_key(16384, 2048, 5504, jnp.float8_e4m3fn, jnp.bfloat16, True, True))
    assert found["sm90"]["tile"]["schedule"] == "pingpong"
    assert found["sm90_cooperative"]["tile"]["schedule"] == "cooperative"


def test_default_timer_times_a_candidate():
    """The default timer compiles and times the op's own call (XLA's candidate runs on the CPU)."""
    from pallas_fused.tune import time_candidate

    key = gemm.gemm_key(128, 256, 128, jnp.float8_e4m3fn, jnp.bfloat16, True, False)
    ms = time_candidate("fp8_gemm", key, "xla", {"impl": "xla"})
    assert 0 < ms < 1000
    call, ops = _tuning.TUNABLES["fp8_gemm"].build(key, {"impl": "xla"})
    a, bt, sa, sb = gemm.gemm_operands(key)[0]
    expect = (a.astype(jnp.float32) * sa[:, None]) @ (bt.astype(jnp.float32) * sb).T
    assert ops == 8 and jnp.allclose(call()[0].astype(jnp.float32), expect, rtol=1e-2, atol=1e-2)


def test_default_timer_refuses_a_candidate_that_computes_something_else(monkeypatch):
    """The default timer checks every candidate's outputs against the first one's of the shape (same operands):
    rounding passes, a wrong result or a NaN raises (so the candidate is recorded as failed, never chosen)."""
    import sys

    tune_module = sys.modules["pallas_fused.tune"]  # the package attribute `pallas_fused.tune` is the function
    x = jax.random.normal(jax.random.key(3), (64, 48))
    outputs = {"one": lambda: [x, 2 * x], "close": lambda: [x * (1 + 1e-3), 2 * x],
               "wrong": lambda: [x, 2 * x + jnp.roll(x, 1)], "nan": lambda: [x.at[5, 7].set(jnp.nan), 2 * x],
               "short": lambda: [x]}
    monkeypatch.setitem(_tuning.TUNABLES, "pair", _tuning.Tunable(
        candidates=lambda key: {name: {} for name in outputs}, build=lambda key, config: (outputs[config["n"]], 1)))
    monkeypatch.setattr(tune_module, "_first", {})
    assert tune_module.time_candidate("pair", "64x48", "one", {"n": "one"}) > 0
    assert tune_module.time_candidate("pair", "64x48", "close", {"n": "close"}) > 0
    for name, why in (("wrong", "output 1 differs"), ("nan", "output 0 differs"), ("short", "1 outputs where")):
        with pytest.raises(ValueError, match=f"{name} disagrees with one: {why}"):
            tune_module.time_candidate("pair", "64x48", name, {"n": name})
    # another shape starts its own reference
    assert tune_module.time_candidate("pair", "32x48", "wrong", {"n": "wrong"}) > 0


def test_command_line(cache, capsys):
    """`python -m pallas_fused.tune`: its arguments checked, naming the option; without a GPU it times nothing and
    prints the (empty) table last."""
    from pallas_fused.tune.__main__ import main

    for bad in (["--shapes", "256x128"], ["--shapes", "axbxc"], ["--scales", "blockwise"]):
        with pytest.raises(SystemExit, match=bad[0]):
            main(bad)
    if _backend.gpu_device() is None:
        with pytest.warns(RuntimeWarning, match="no GPU"):
            assert main(["--shapes", "256x128x128", "--budget", "5", "--no-progress"]) == 0
        assert capsys.readouterr().out.strip().endswith("cache: None")
