"""Backs docs/gpu_tests.md's account of jax 0.12's wrong adapter gradients: `tests/adapt/_gqa_cotangent.py`'s
plain-jnp reproducer (no pallas_fused, no kernel), with XLA's default options and with its Triton GEMM fusions off.

    python benchmarks/probes/xla_gqa_cotangent_probe.py
"""

import jax

from tests.adapt._gqa_cotangent import NO_TRITON_GEMM, attention_gradients, gradients

if __name__ == "__main__":
    print("jax", jax.__version__, jax.devices(), flush=True)
    for name, fn in (("value projection", gradients), ("q, k, v projections", attention_gradients)):
        print(name, "default options", fn(), flush=True)
        if jax.default_backend() == "gpu":
            print(name, "Triton GEMM off", fn(NO_TRITON_GEMM), flush=True)
