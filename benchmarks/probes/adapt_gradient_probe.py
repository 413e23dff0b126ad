"""Backs docs/gpu_tests.md's account of the adapted HF Llama's wrong adapter gradients on jax 0.12 GPUs.

Development probe, four stages, each judging 16-bit runs (relative error per output) against float32, or FP8
against XLA's FP8 recipe:

    ops     `lora_dense` and `dora_dense` (dense and NF4 weights) alone, jitted vjp, at the adapt GPU test's
            shapes (512 tokens; 512 -> 512, 256, 1024 and 1024 -> 512, rank 16): the kernels' and XLA's y, dx, dA,
            dB (and the magnitude's gradient)
    model   the adapt GPU test's HF Flax Llama (transformers 4.x) with LoRA on one group of projections at a time
            (a regex alternation; default: q|k|v, then o, then the MLP's three): each adapter leaf's gradient,
            kernels and XLA
    fp8     the model with FP8 (rowwise) on one group: each weight's gradient through the kernels against XLA's FP8
            recipe (no float32 judge: the recipe's own rounding is the point of comparison)
    layers  the model with LoRA on one group in both layers, one layer through the kernels and the other through
            XLA, each way round: which layer's kernels make layer 0's gradients wrong

    python benchmarks/probes/adapt_gradient_probe.py ops|model|fp8|layers [GROUP ...] [--impl pallas|interpret]
        [--xla-in fwd|bwd ...]

The kernels' implementation is "pallas" (a GPU) unless --impl says otherwise ("interpret" on a CPU).
`--xla-in` replaces LoRA's sm90 GEMM in its forward (fwd) or backward (bwd) by XLA's dots, inside the same
custom VJP: which of the two kernels, run inside the model, is wrong.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from pallas_fused import adapt
from pallas_fused.dora import dequantize, dora_dense, lora_dense, quantize_nf4
from pallas_fused.dora import impls as dora_impls
from tests.helpers import rel_err

TOKENS, RANK, SCALE = 512, 16, 2.0
SHAPES = [(512, 512), (512, 256), (512, 1024), (1024, 512)]
GROUPS = ["q_proj|k_proj|v_proj", "o_proj", "gate_proj|up_proj|down_proj"]


def _normal(key, shape, scale=1.0):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale


def _vjp_errors(fn, args, cotangent, impl):
    """fn(*args, implementation) and its vjp at `cotangent`, in bf16 through `impl` and XLA, each against XLA in
    float32 at full precision: {impl: [error of y, then of each argument's gradient]}."""
    outs = {}
    for name, dtype, run in ((impl, jnp.bfloat16, impl), ("xla", jnp.bfloat16, "xla"), ("f32", jnp.float32, "xla")):
        with jax.default_matmul_precision("highest"):
            y, vjp = jax.jit(lambda *v, run=run: jax.vjp(lambda *u: fn(*u, run), *v))(*[a.astype(dtype) for a in args])
            outs[name] = (y, *jax.jit(vjp)(cotangent.astype(y.dtype)))
    return {name: [rel_err(got, want) for got, want in zip(outs[name], outs["f32"])] for name in (impl, "xla")}


def ops(impl):
    for fin, fout in SHAPES:
        layer = dora_impls.DoraArgs.shaped("dense", TOKENS, fin, fout, RANK, jnp.bfloat16)
        print(f"-- {fin}->{fout}: dora variant {dora_impls.choose(layer, dora_impls.current_device()).variant}",
              flush=True)
        x, w, g = _normal(1, (TOKENS, fin)), _normal(2, (fin, fout), fin ** -0.5), _normal(5, (TOKENS, fout))
        a, b = _normal(3, (fin, RANK), fin ** -0.5), _normal(4, (RANK, fout), 0.05)
        nf4 = quantize_nf4(w)
        m_dense = jnp.linalg.norm(w + SCALE * a @ b, axis=0) * (1 + 0.1 * _normal(6, (fout,)))
        m_nf4 = jnp.linalg.norm(dequantize(nf4, jnp.float32) + SCALE * a @ b, axis=0)
        cases = {
            "lora": (lambda x, a, b, i, w=w: lora_dense(x, w, a, b, scale=SCALE, implementation=i), (x, a, b)),
            "dora": (lambda x, a, b, m, i, w=w: dora_dense(x, w, a, b, m, scale=SCALE, implementation=i),
                     (x, a, b, m_dense)),
            "nf4": (lambda x, a, b, m, i, q=nf4: dora_dense(x, q, a, b, m, scale=SCALE, implementation=i),
                    (x, a, b, m_nf4)),
        }
        for name, (fn, args) in cases.items():
            errs = _vjp_errors(fn, args, g, impl)
            labels = ["y", "dx", "da", "db", "dm"][: len(errs["xla"])]
            print(f"  {name}: " + "  ".join(f"{lab} {impl} {e1:.4f} xla {e2:.4f}"
                                            for lab, e1, e2 in zip(labels, errs[impl], errs["xla"])), flush=True)


def xla_in(stages):
    """LoRA's sm90 GEMM replaced by XLA's dots in its forward ("kn") and/or backward ("nk") launches."""
    from pallas_fused.dora import lora

    kernel, layouts = lora._sm90, {"fwd": "kn", "bwd": "nk"}

    def dots(x, w, la, lb, bias, b_layout, interpret):
        if b_layout not in [layouts[s] for s in stages]:
            return kernel(x, w, la, lb, bias, b_layout, interpret)
        wk, lbk = (w, lb) if b_layout == "kn" else (w.T, lb.T)
        y = jnp.dot(x, wk, preferred_element_type=jnp.float32) + jnp.dot(la, lbk, preferred_element_type=jnp.float32)
        return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)

    lora._sm90 = dots


def _layer_rules(group, impls):
    """LoRA on `group`; impls: one implementation for every layer, or {layer: implementation}."""
    if isinstance(impls, str):
        return [adapt.LoraRule(module_path=rf".*/({group})", rank=RANK, alpha=32.0, implementation=impls)]
    return [adapt.LoraRule(module_path=rf".*/layers/{layer}/.*/({group})", rank=RANK, alpha=32.0, implementation=i)
            for layer, i in impls.items()]


def model(groups, impl, layers=False):
    from tests.adapt._models import adapted_params, float32_reference, loss_and_adapter_grads
    from tests.adapt.test_gpu import _llama

    module, pretrained, inputs, targets = _llama()
    runs_of = ([(f"L0 {impl} L1 xla", {0: impl, 1: "xla"}), (f"L0 xla L1 {impl}", {0: "xla", 1: impl})] if layers
               else [(impl, impl)])
    for group, (label, impls) in ((g, r) for g in groups for r in runs_of):
        start = time.time()

        def rules(i, group=group, impls=impls):
            return _layer_rules(group, impls if i != "xla" else "xla")

        runs = {}
        for i in (impl, "xla"):
            lmodel, params = adapted_params(module, rules(i), inputs, pretrained)
            runs[i] = loss_and_adapter_grads(lmodel, params, inputs, targets)
        loss32, grads32 = float32_reference(module, rules("xla"), params, inputs, targets)
        print(f"-- lora on {group}, {label}: loss {impl} {float(runs[impl][0]):.5f} xla {float(runs['xla'][0]):.5f} "
              f"f32 {float(loss32):.5f} ({time.time() - start:.0f} s)", flush=True)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads32)[0]]
        for path, got, base, want in zip(paths, jax.tree.leaves(runs[impl][1]), jax.tree.leaves(runs["xla"][1]),
                                         jax.tree.leaves(grads32)):
            print(f"   {path}: {impl} {rel_err(got, want):.4f} xla {rel_err(base, want):.4f}", flush=True)


def fp8(groups, impl):
    from tests.adapt._models import lm_loss
    from tests.adapt.test_gpu import _llama

    module, pretrained, inputs, targets = _llama()
    for group in groups:
        runs = {}
        for i in (impl, "xla"):
            rules = [adapt.Fp8Rule(module_path=rf".*/({group})", recipe="rowwise", implementation=i)]
            lmodel = adapt.apply(module, rules)
            params = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), *inputs), pretrained)["params"]
            runs[i] = jax.jit(jax.value_and_grad(
                lambda p, lmodel=lmodel: lm_loss(lmodel.apply({"params": p}, *inputs).logits, targets)))(params)
        print(f"-- fp8 rowwise on {group}: loss {impl} {float(runs[impl][0]):.5f} xla {float(runs['xla'][0]):.5f}",
              flush=True)
        for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(runs[impl][1])[0],
                                     jax.tree.leaves(runs["xla"][1])):
            if "proj" in jax.tree_util.keystr(path):
                print(f"   {jax.tree_util.keystr(path)}: {impl} vs xla {rel_err(got, want):.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["ops", "model", "fp8", "layers"])
    parser.add_argument("groups", nargs="*", default=GROUPS)
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--xla-in", nargs="*", choices=["fwd", "bwd"], default=[])
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), "XLA in LoRA's", args.xla_in or "nothing", flush=True)
    if args.xla_in:
        xla_in(args.xla_in)
    if args.stage == "ops":
        ops(args.impl)
    elif args.stage == "fp8":
        fp8(args.groups, args.impl)
    else:
        model(args.groups, args.impl, layers=args.stage == "layers")


if __name__ == "__main__":
    main()
