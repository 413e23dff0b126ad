"""Smoke tests of the main example, examples/train_llama.py, on CPU with a tiny model.

They run the real pipeline end to end (stdlib corpus, pretraining with galore_adamw, orbax checkpoint,
DoRA fine-tune, plot and report) and check what a user would look at: the held-out loss goes down, the
checkpoint restores bit-identical, the fine-tune touches only the adapters, and the files are written.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

TINY = ["--preset", "cpu", "--d-model", "64", "--n-layers", "2", "--seq-len", "64", "--batch-size", "8",
        "--galore-rank", "8", "--update-proj-gap", "10", "--lr", "1e-2", "--no-progress"]


# Floor leg only: the training run at the length that shows the loss falling; the newest leg runs the same
# pipeline (checkpoint, DoRA fine-tune, report and plot) for a few steps in test_multi_process.py.
@pytest.mark.slow
def test_pretrain_checkpoint_finetune_report(train_llama, tmp_path):
    out = train_llama.main(TINY + ["--steps", "40", "--finetune-steps", "12", "--eval-every", "20",
                                   "--out", str(tmp_path)])
    pre, ft = out["results"]
    assert (pre.phase, ft.phase) == ("pretrain", "dora finetune")

    # Held-out validation loss goes down (a clear margin: it starts near ln(256) = 5.5 nats / byte).
    assert pre.val_steps == [0, 20, 40]
    assert pre.val_loss[-1] < pre.val_loss[0] - 1.0, pre.val_loss
    assert all(loss == loss for loss in pre.train_loss)  # no NaN
    assert ft.val_loss[-1] < ft.val_loss[0], ft.val_loss

    checks = out["checks"]["pallas_fused"]
    assert checks["checkpoint_restored_identical"] is True
    assert pathlib.Path(checks["checkpoint"]).is_dir()
    # Only adapters changed in the fine-tune, and every kind of adapter did.
    changed = checks["finetune_changed"]
    assert checks["finetune_only_adapters_changed"] is True
    assert {c.rsplit("/", 1)[-1] for c in changed} == {"kernel_lora_a", "kernel_lora_b", "kernel_magnitude"}
    assert ft.num_trainable < ft.num_params

    paths = out["paths"]
    for key in ("plot", "markdown", "json"):
        assert paths[key].is_file() and paths[key].stat().st_size > 0
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(paths["json"].read_text())
    assert [r["phase"] for r in record["runs"]] == ["pretrain", "dora finetune"]
    assert "| pretrain | pallas_fused |" in paths["markdown"].read_text()


@pytest.mark.slow
def test_compare_runs_baseline(train_llama, tmp_path):
    # --optax-path: galore_adamw's update + apply_updates (the first test covers the in-place step). One layer:
    # the layers are unrolled, so each one is compiled again in each of the four runs.
    out = train_llama.main(TINY + ["--n-layers", "1", "--steps", "6", "--finetune-steps", "3", "--eval-every", "3",
                                   "--compare", "--optax-path", "--out", str(tmp_path)])
    runs = {(r.phase, r.name): r for r in out["results"]}
    assert set(runs) == {(p, n) for p in ("pretrain", "dora finetune") for n in ("pallas_fused", "baseline")}
    ours, base = runs[("pretrain", "pallas_fused")], runs[("pretrain", "baseline")]
    # Same initial params, same validation set; same batches and the same GaLore numbers (up to the projector).
    assert ours.val_loss[0] == pytest.approx(base.val_loss[0], rel=1e-5)
    assert ours.val_loss[-1] == pytest.approx(base.val_loss[-1], rel=0.02)
    assert base.val_loss[-1] < base.val_loss[0]
    for run in out["results"]:
        assert run.step_ms > 0 and run.train_loss[-1] == run.train_loss[-1]
    assert out["checks"]["baseline"]["finetune_only_adapters_changed"] is True
    text = out["paths"]["markdown"].read_text()
    assert "| pretrain | baseline |" in text and "- pretrain: val loss" in text


# Floor leg only: on the newest leg the quantized fine-tune's parts run in test_qdora_nf4_params_model_and_checkpoint
# (the QDoRA model, its params and checkpoint), tests/dora (the QDoRA kernels) and test_multi_process.py (the
# fine-tune's pipeline).
@pytest.mark.slow
def test_qdora_finetune_int8(train_llama, tmp_path):
    """`--quantize int8`: both fine-tunes (pallas_fused and the --compare baseline) train adapters on the same int8
    base; `--steps 0` skips pretraining, so the run is the fine-tune alone."""
    out = train_llama.main(TINY + ["--n-layers", "1", "--steps", "0", "--finetune-steps", "3", "--eval-every", "3",
                                   "--quantize", "int8", "--compare", "--out", str(tmp_path)])
    runs = {(r.phase, r.name): r for r in out["results"]}
    assert set(runs) == {("dora finetune", "pallas_fused"), ("dora finetune", "baseline")}
    for name, checks in out["checks"].items():
        assert checks["finetune_base_kernels"] == ["int8"], name
        assert checks["finetune_only_adapters_changed"] is True, name
        assert "checkpoint" not in checks  # nothing pretrained, nothing checkpointed
    ours, base = runs[("dora finetune", "pallas_fused")], runs[("dora finetune", "baseline")]
    assert all(np.isfinite(ours.train_loss)) and ours.val_loss[-1] < ours.val_loss[0]
    assert ours.val_loss[0] == pytest.approx(base.val_loss[0], rel=1e-5)  # the same quantized weights
    # The model's weight count, not the int8 codes and scales: what the MFU column divides by.
    assert ours.num_params == out["settings"]["num_params"] + ours.num_trainable
    record = json.loads(out["paths"]["json"].read_text())
    assert record["settings"]["quantize"] == "int8"
    assert all("peak_bytes" in r for r in record["runs"])
    text = out["paths"]["markdown"].read_text()
    assert "on an int8 base (QDoRA)" in text and "| peak memory (GB) |" in text
    if ours.peak_bytes is None:  # CPU: no memory statistics, the column says so
        rows = [line for line in text.splitlines() if line.startswith("| dora finetune |")]
        assert len(rows) == 2 and all(row.endswith("| - |") for row in rows)


def test_qdora_nf4_params_model_and_checkpoint(train_llama, tmp_path):
    """`--quantize nf4` without a training run: the fine-tune's params (adapt.from_pretrained) hold NF4 kernels, the
    QDoRA model starts out computing the plain model on the dequantized kernels (magnitude = their column norms,
    B = 0), and the example's orbax helpers round-trip the quantized tree."""
    import jax
    from flax import traverse_util

    from pallas_fused import adapt

    s = dict(train_llama.PRESETS["cpu"], d_model=32, n_layers=1, d_ff=64, dora_rank=4)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
    plain = train_llama.Llama(train_llama.model_config(s, implementation="xla"))
    params = jax.jit(plain.init)(jax.random.key(1), tokens)["params"]
    qdora = train_llama.finetune_model(s, implementation="xla", quantize="nf4")
    ft = jax.jit(lambda p: train_llama.dora_params(qdora, p, jax.random.key(2)))(params)
    assert train_llama.base_kernel_formats(ft) == ["nf4"]
    assert adapt.unused_rules(qdora) == []
    flat, flat_ft = traverse_util.flatten_dict(params), traverse_util.flatten_dict(ft)
    keys = train_llama.adapter_keys(ft)
    assert {k[-1] for k in keys} == {"kernel_lora_a", "kernel_lora_b", "kernel_magnitude"}
    assert {k[:-1] for k in keys} == {k[:-1] for k in flat if k[0].startswith("block_") and k[-1] == "kernel"}
    adapters = sum(flat_ft[k].size for k in keys)
    assert train_llama.count_params(ft) == train_llama.count_params(params) + adapters  # weights, not packed codes

    # the plain model with every block kernel replaced by its dequantized NF4 copy
    merged = adapt.merge(qdora, {"params": ft})["params"]
    deq = {k: flat_ft[k].dense() if isinstance(flat_ft.get(k), adapt.QuantizedWeight) else v for k, v in flat.items()}
    k_up = ("block_0", "mlp", "up", "kernel")
    assert not np.array_equal(deq[k_up], flat[k_up])  # NF4 rounds: the check below is not of the dense model
    want = jax.jit(lambda p: plain.apply({"params": p}, tokens))(traverse_util.unflatten_dict(deq))
    got = jax.jit(lambda p: qdora.apply({"params": p}, tokens))(ft)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(plain.apply({"params": merged}, tokens)), np.asarray(want), rtol=1e-4,
                               atol=1e-4)

    train_llama.save_checkpoint(tmp_path / "ft", ft)
    back = train_llama.restore_checkpoint(tmp_path / "ft", ft)
    assert isinstance(back["block_0"]["mlp"]["up"]["kernel"], adapt.QuantizedWeight)
    assert jax.tree.structure(back) == jax.tree.structure(ft)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ft), jax.tree.leaves(back)))


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "int8", "--finetune-steps", "0"], "--quantize int8 quantizes the DoRA fine-tune"),
    (["--quantize", "nf4", "--dora-rank", "0"], "needs a fine-tune"),
    (["--steps", "0", "--finetune-steps", "0"], "--steps 0 skips pretraining"),
])
def test_quantize_needs_a_finetune(train_llama, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        train_llama.parse_args(TINY + extra + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_corpus_splits_are_disjoint_and_deterministic(train_llama):
    data = train_llama.data
    files = data.list_files()
    names = {split: {p.as_posix() for p in paths} for split, paths in files.items()}
    assert all(names[s] for s in data.SPLITS)
    for i, a in enumerate(data.SPLITS):
        for b in data.SPLITS[i + 1:]:
            assert not names[a] & names[b], (a, b)
    assert data.list_files() == files  # sorted, same every call
    stream = data.load_split("pretrain_val")
    assert stream.dtype == np.uint8 and (stream == data.SEPARATOR).sum() >= len(files["pretrain_val"])
    first = next(data.Batches(stream, 4, 32, seed=3))
    again = next(data.Batches(stream, 4, 32, seed=3))
    np.testing.assert_array_equal(first, again)
    assert first.shape == (4, 33) and not np.array_equal(first, next(data.Batches(stream, 4, 32, seed=4)))
    with pytest.raises(ValueError, match="split"):
        data.load_split("nope")


@pytest.mark.gpu
def test_gpu_pallas_compare_fp8(train_llama, tmp_path):
    """The GPU path end to end at a small size: Pallas kernels everywhere, FP8 tensorwise, bf16, --compare."""
    out = train_llama.main(["--preset", "gpu", "--d-model", "256", "--n-layers", "2", "--seq-len", "256",
                            "--batch-size", "8", "--galore-rank", "32", "--update-proj-gap", "20", "--steps", "60",
                            "--finetune-steps", "20", "--eval-every", "20", "--implementation", "pallas",
                            "--fp8", "tensorwise", "--compare", "--no-progress", "--out", str(tmp_path)])
    runs = {(r.phase, r.name): r for r in out["results"]}
    ours, base = runs[("pretrain", "pallas_fused")], runs[("pretrain", "baseline")]
    assert ours.val_loss[-1] < ours.val_loss[0] - 1.0
    assert abs(ours.val_loss[-1] - base.val_loss[-1]) / base.val_loss[-1] < 0.05, (ours.val_loss, base.val_loss)
    ft = runs[("dora finetune", "pallas_fused")]
    assert ft.val_loss[-1] < ft.val_loss[0]
    for checks in out["checks"].values():
        assert checks["checkpoint_restored_identical"] and checks["finetune_only_adapters_changed"]


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_gpu_qdora_finetune_compare(train_llama, tmp_path, quantize):
    """QDoRA on the GPU at a small size: the Pallas DoRA kernels on a quantized base against the XLA reference on
    the same base (--compare), fine-tune only (--steps 0), bf16; the peak memory is reported."""
    out = train_llama.main(["--preset", "gpu", "--d-model", "256", "--n-layers", "2", "--seq-len", "256",
                            "--batch-size", "8", "--steps", "0", "--finetune-steps", "20", "--eval-every", "20",
                            "--implementation", "pallas", "--quantize", quantize, "--compare", "--no-progress",
                            "--out", str(tmp_path)])
    runs = {r.name: r for r in out["results"]}
    ours, base = runs["pallas_fused"], runs["baseline"]
    assert ours.val_loss[-1] < ours.val_loss[0]
    assert abs(ours.val_loss[-1] - base.val_loss[-1]) / base.val_loss[-1] < 0.02, (ours.val_loss, base.val_loss)
    assert ours.peak_bytes is not None and base.peak_bytes >= ours.peak_bytes  # a process-wide high-water mark
    for checks in out["checks"].values():
        assert checks["finetune_base_kernels"] == [quantize] and checks["finetune_only_adapters_changed"]


def test_model_kernels_keep_the_param_tree(train_llama):
    """The embedding and RMSNorm drop-ins: the same param tree under every implementation, flax's own layers
    under "xla" (the baseline's numbers), and the kernels' loss and gradients close to them."""
    import jax
    import jax.numpy as jnp
    from llama.model import Llama

    s = dict(train_llama.PRESETS["cpu"], d_model=32, n_layers=1, d_ff=64)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
    models = {impl: Llama(train_llama.model_config(s, implementation=impl)) for impl in ("xla", "interpret")}
    params = models["xla"].init(jax.random.key(1), tokens)["params"]
    ours = models["interpret"].init(jax.random.key(1), tokens)["params"]
    assert jax.tree.structure(params) == jax.tree.structure(ours)
    assert params["embed"]["embedding"].shape == (256, 32) and params["final_norm"]["scale"].shape == (32,)

    def loss(p, impl):
        return jnp.mean(models[impl].apply({"params": p}, tokens) ** 2)

    (l_ref, g_ref), (l_ours, g_ours) = (jax.value_and_grad(loss)(params, impl) for impl in ("xla", "interpret"))
    np.testing.assert_allclose(float(l_ours), float(l_ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)


def test_fp8_blockwise_flag(train_llama, tmp_path):
    """`--fp8 blockwise` reaches the model's projections: DeepSeek-V3's recipe, the same param tree as the bf16
    model, and a loss and gradients close to it (a few training steps would add ~13 s to CI)."""
    import jax
    import jax.numpy as jnp
    from llama.model import Llama

    args = train_llama.parse_args(TINY + ["--fp8", "blockwise", "--out", str(tmp_path)])
    assert args.fp8 == "blockwise"
    s = dict(train_llama.PRESETS["cpu"], d_model=32, n_layers=1, d_ff=64)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
    models = {fp8: Llama(train_llama.model_config(s, implementation="xla", fp8=fp8)) for fp8 in (None, args.fp8)}
    params = models[None].init(jax.random.key(1), tokens)["params"]
    shapes = jax.eval_shape(models["blockwise"].init, jax.random.key(1), tokens)["params"]
    assert jax.tree.structure(shapes) == jax.tree.structure(params)

    def loss(p, fp8):
        return jnp.mean(models[fp8].apply({"params": p}, tokens).astype(jnp.float32) ** 2)

    (l_ref, g_ref), (l_fp8, g_fp8) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, fp8)
                                      for fp8 in (None, "blockwise"))
    assert float(l_fp8) != float(l_ref) and abs(float(l_fp8) - float(l_ref)) <= 0.05 * abs(float(l_ref))
    for a, b in zip(jax.tree.leaves(g_fp8), jax.tree.leaves(g_ref)):  # e4m3's 3 mantissa bits, through the layer
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 0.3 * np.linalg.norm(b) + 1e-6


def test_fused_loss_head(train_llama):
    """`fused_loss` (pallas_fused.loss as the head, the example's default for pallas_fused; the baseline keeps
    nn.Dense and optax): the same param tree, and the loss and every gradient close to the logits path's. The
    report's memory line compares the two at the run's shapes: the fused one plans fewer bytes."""
    import jax
    import jax.numpy as jnp
    from llama.model import Llama
    from llama.train import loss_fn, loss_memory

    s = dict(train_llama.PRESETS["cpu"], d_model=32, n_layers=1, d_ff=64)
    batch = jax.random.randint(jax.random.key(0), (2, 18), 0, 256)
    models = {(impl, fused): Llama(train_llama.model_config(s, implementation=impl, fused_loss=fused))
              for impl, fused in (("xla", False), ("xla", True), ("interpret", True))}
    params = models["xla", False].init(jax.random.key(1), batch[:, :-1])["params"]
    shapes = jax.eval_shape(models["interpret", True].init, jax.random.key(1), batch[:, :-1], batch[:, 1:])
    assert jax.tree.structure(shapes["params"]) == jax.tree.structure(params)
    logits = models["xla", False].apply({"params": params}, batch[:, :-1])  # no labels: the logits, as before
    assert logits.shape == (2, 17, 256) and logits.dtype == jnp.float32

    ref, g_ref = jax.value_and_grad(lambda p: loss_fn(models["xla", False], p, batch))(params)
    assert 5.0 < float(ref) < 8.0  # about ln(256) = 5.5 at init, more with random logits
    for key in (("xla", True), ("interpret", True)):
        val, grads = jax.value_and_grad(lambda p, m=models[key]: loss_fn(m, p, batch))(params)
        np.testing.assert_allclose(float(val), float(ref), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)

    memory = loss_memory(4096, 64, 256, jnp.float32, "xla")
    assert set(memory) == {"fused", "materialized"}
    if memory["materialized"] is not None:  # a backend that plans its memory
        assert memory["fused"] < memory["materialized"], memory
    # a model as wide as its byte vocabulary (the GPU tests' d_model 256): a square head kernel
    assert set(loss_memory(512, 256, 256, jnp.float32, "xla")) == {"fused", "materialized"}
