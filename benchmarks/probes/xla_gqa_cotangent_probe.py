"""Backs docs/gpu_tests.md's account of jax 0.12's wrong gradients through grouped-query attention on the GPU, every
number judged against float32 autodiff on the CPU:

- `tests/adapt/_gqa_cotangent.py`'s plain-jnp reproducer (no pallas_fused): the value projection differentiated by
  jax and through a custom VJP, in bf16 and float32, with XLA's default options and with its Triton GEMM fusions
  off; and q, k and v projections under the attention they feed;
- `--model`: the adapt GPU test's HF Flax Llama (8 query heads, 4 key-value heads), plain (every weight's
  gradient, bf16 and float32), and with LoRA and DoRA on its seven projections through the kernels and through
  XLA (the adapters' gradients).

    [XLA_FLAGS=--xla_disable_hlo_passes=reduce-decomposer] python benchmarks/probes/xla_gqa_cotangent_probe.py [--model]
"""

import argparse

import jax
import jax.numpy as jnp

from tests.adapt._gqa_cotangent import NO_TRITON_GEMM, attention_gradients, gradients
from tests.helpers import float32_judge_on_cpu, rel_err


def _worst(name, got, want):
    """Prints the largest error of `got`'s leaves against `want`'s, and the three worst leaves by path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(want)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    errs = [rel_err(g, w) for g, (_, w) in zip(jax.tree.leaves(got), flat)]
    worst = sorted(zip(errs, paths), reverse=True)[:3]
    print(f"{name}: max {max(errs):.4f};", ", ".join(f"{p} {e:.4f}" for e, p in worst), flush=True)


def model_rows():
    from tests.adapt._models import adapted_params, float32_reference, lm_loss, loss_and_adapter_grads, upcast_float32
    from tests.adapt.test_gpu import CASES, _llama

    module, pretrained, inputs, targets = _llama()

    def plain(mod, params, inputs, targets):
        return jax.jit(jax.grad(lambda p: lm_loss(mod.apply({"params": p}, *inputs).logits, targets)))(params)

    m32, up = module.clone(dtype=jnp.float32), upcast_float32(pretrained)
    with float32_judge_on_cpu() as cpu:
        want = plain(m32, *jax.device_put((up, inputs, targets), cpu))
    _worst("plain Llama, bf16", plain(module, pretrained, inputs, targets), want)
    with jax.default_matmul_precision("highest"):
        _worst("plain Llama, float32", plain(m32, up, inputs, targets), want)
    impl = "pallas" if jax.default_backend() == "gpu" else "interpret"
    for kind in ("lora", "dora"):
        lmodel, params = adapted_params(module, CASES[kind](impl), inputs, pretrained)
        _, want = float32_reference(module, CASES[kind]("xla"), params, inputs, targets)
        _, got = loss_and_adapter_grads(lmodel, params, inputs, targets)
        _worst(f"{kind}, kernels, bf16", got, want)
        xla_model, _ = adapted_params(module, CASES[kind]("xla"), inputs, pretrained)
        _worst(f"{kind}, XLA, bf16", loss_and_adapter_grads(xla_model, params, inputs, targets)[1], want)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="store_true", help="also the HF Llama rows (transformers 4.x)")
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    options = [("default options", None)] + ([("Triton GEMM off", NO_TRITON_GEMM)] * (jax.default_backend() == "gpu"))
    for label, opts in options:
        for custom_vjp in (True, False):
            for dtype in (jnp.bfloat16, jnp.float32):
                how = f"{'custom VJP' if custom_vjp else 'autodiff'}, {jnp.dtype(dtype).name}"
                print(f"value projection, {how}, {label}:",
                      gradients(opts, custom_vjp=custom_vjp, dtype=dtype), flush=True)
        print(f"q, k, v projections, custom VJP, bfloat16, {label}:", attention_gradients(opts), flush=True)
    if args.model:
        model_rows()
