"""The example's choices that a user reads off its report: which attention ran, and MFU per device.

Attention: by default cuDNN on a GPU where a probe of it works, else XLA; a CPU keeps XLA without probing. Here
(no GPU) the real probe fails, which is the fallback's path; a succeeding probe is mocked. MFU: the step's global
FLOPs over the peak of every device it ran on, checked on mocked 1, 2 and 4-device runs.
"""

from __future__ import annotations

import json

import pytest

# The fused AdamW rather than the default GaLore: the report is what is checked, and GaLore's programs would double
# the run's compile time.
TINY = ["--preset", "cpu", "--d-model", "32", "--n-layers", "1", "--seq-len", "32", "--batch-size", "4",
        "--optimizer", "adamw", "--steps", "2", "--finetune-steps", "0", "--eval-every", "100", "--no-progress",
        "--max-bytes", "200000"]


def _settings(train_llama, **over):
    return dict(train_llama.PRESETS["gpu"], **over)


def test_attention_on_cpu_is_xla_without_a_probe(train_llama):
    def probe(_):
        raise AssertionError("a CPU must not probe cuDNN")

    assert train_llama.choose_attention(None, _settings(train_llama), gpu=False, probe=probe) == (
        "xla", "default: XLA (no GPU)")


def test_attention_probe_passes_gives_cudnn(train_llama):
    seen = []
    impl, reason = train_llama.choose_attention(None, _settings(train_llama), gpu=True, probe=seen.append)
    assert impl == "cudnn" and "probe passed" in reason and "bfloat16" in reason and "head dim 128" in reason
    assert seen and seen[0]["n_heads"] == 16  # the model's own settings reach the probe


def test_attention_real_probe(train_llama):
    """The real probe, told there is a GPU. Without one (no cuDNN) whatever it raises sends the run to XLA, named;
    on a GPU with cuDNN attention it passes at the GPU preset's bf16 heads."""
    impl, reason = train_llama.choose_attention(None, _settings(train_llama, seq_len=64), gpu=True)
    if train_llama.has_gpu():
        assert impl == "cudnn", reason
    else:
        assert impl == "xla" and reason.startswith("default: XLA (cuDNN's probe failed: ")


@pytest.mark.parametrize("requested", ["xla", "cudnn"])
def test_attention_chosen_by_the_user_is_kept(train_llama, requested):
    def probe(_):
        raise AssertionError("a user's choice is not probed")

    assert train_llama.choose_attention(requested, _settings(train_llama), gpu=True, probe=probe) == (
        requested, f"--attention {requested}")


def test_attention_bad_choice_names_the_argument(train_llama):
    with pytest.raises(ValueError, match="--attention must be one of"):
        train_llama.choose_attention("flash", _settings(train_llama))


def test_report_says_which_attention_ran(train_llama, tmp_path, monkeypatch):
    """The whole example on a pretend GPU whose cuDNN probe fails: XLA runs, and report.md / report.json say so."""
    def probe(_):
        raise RuntimeError("cuDNN is not detected.")

    monkeypatch.setattr(train_llama, "has_gpu", lambda: True)
    monkeypatch.setattr(train_llama, "probe_cudnn_attention", probe)
    out = train_llama.main(TINY + ["--out", str(tmp_path / "run")])
    assert out["settings"]["attention"] == "xla"
    record = json.loads(out["paths"]["json"].read_text())
    assert record["settings"]["attention"] == "xla"
    assert record["settings"]["attention_reason"] == "default: XLA (cuDNN's probe failed: RuntimeError: cuDNN is not " \
                                                     "detected.)"
    assert "Attention (jax.nn.dot_product_attention, both runs): xla (default: XLA (cuDNN's probe failed" in \
        out["paths"]["markdown"].read_text()
    assert record["runs"][0]["num_devices"] == 1


# ------------------------------------------------------------------------------------------------------------ MFU


def _run(n_devices: int, step_ms: float, per_device_batch: int = 16, seq_len: int = 1024):
    from llama.train import RunResult

    return RunResult(name="pallas_fused", phase="pretrain", val_loss=[3.0, 2.0], train_loss=[2.5],
                     windows=[(10, step_ms * 10 / 1000.0)] * 3, timed_steps=30, train_s=step_ms * 30 / 1000.0,
                     tokens_per_step=n_devices * per_device_batch * seq_len, num_devices=n_devices,
                     num_params=311_195_648)


@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_mfu_is_per_device(train_llama, n_devices):
    """Weak scaling at the same step time: global tokens / s grow n times, MFU per device stays that of one."""
    from llama import report

    settings = {"n_layers": 7, "d_model": 2048, "seq_len": 1024}
    run = _run(n_devices, step_ms=100.0)
    flops_per_token = 6.0 * 311_195_648 + 12.0 * 7 * 2048 * 1024
    tokens_per_s = n_devices * 16 * 1024 / 0.1
    assert run.median_tokens_per_s == pytest.approx(tokens_per_s)
    expected = flops_per_token * tokens_per_s / (n_devices * 989.4e12)
    assert report.mfu(run, settings, "NVIDIA H200") == pytest.approx(expected)
    assert report.mfu(run, settings, "NVIDIA H200") == pytest.approx(report.mfu(_run(1, 100.0), settings,
                                                                                "NVIDIA H200"))
    assert 0.0 < expected < 1.0
    row = report.table([run], settings, "NVIDIA H200").splitlines()[-1]
    assert f"| {n_devices} | {tokens_per_s:,.0f} | {100 * expected:.1f}% |" in row


def test_mfu_rejects_a_bad_device_count(train_llama):
    from llama import report

    with pytest.raises(ValueError, match="num_devices"):
        report.mfu(_run(0, 100.0), {"n_layers": 7, "d_model": 2048, "seq_len": 1024}, "NVIDIA H200")
