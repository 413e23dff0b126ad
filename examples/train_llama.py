"""Train a Llama-style byte-level model on the Python standard library, with every pallas_fused capability.

    python examples/train_llama.py                        # --preset cpu without a GPU: ~3 minutes on 2 cores
    python examples/train_llama.py --preset gpu --compare # ~300M params, seq 1024, bf16, against the baseline
    python examples/train_llama.py --mesh data=2          # data parallel on 2 devices (--mesh fsdp=2: FSDP)
    python examples/train_llama.py --preset gpu --quantize int8 --compare   # QDoRA: an int8 (or nf4) frozen base
    srun --ntasks-per-node=8 python examples/train_llama.py --mesh fsdp=16     # one process per GPU, 2 hosts
    python examples/train_llama.py --coordinator host0:1234 --num-processes 2 --process-id 0 ...  # by hand

What it does:
  1. pretraining: a Llama decoder (RMSNorm, rotary attention with grouped-query heads, SwiGLU) on the
     stdlib's library modules, with `galore_adamw` (GaLore on the block projections, fused AdamW on the
     rest), rotary from `pallas_fused.rotary`, optionally FP8 block projections (`--fp8 <recipe>`), and the
     loss from `pallas_fused.loss` (the output head's logits never written; the report says what that saves);
  2. an orbax checkpoint of the pretrained params, restored (and checked bit-identical) for
  3. a DoRA fine-tune (`--dora-rank`) on a different slice of the corpus (the stdlib's test suites):
     the base weights frozen, only lora_a / lora_b / magnitude trained, with the fused AdamW; with
     `--quantize int8|nf4` the frozen block projection kernels are stored quantized (QDoRA);
  4. a loss plot (train + held-out validation), report.md and report.json under `--out`.

`--mesh data=N` trains data parallel on N devices (batch split, params replicated); `--mesh fsdp=N` splits
the batch and every 2-D weight, gradient and optimizer state along one axis over N devices (see
examples/llama/mesh.py); `data=A,fsdp=B` combines them. The batch size is the global one.

Several processes (one per host or per GPU; docs/multi_process.md): under a cluster launcher jax detects
(Slurm's srun, Open MPI's mpirun), or with `--coordinator HOST:PORT --num-processes N --process-id I`, the
example starts `jax.distributed` first; the mesh then spans every process' devices (default `data=<all>`),
each process reads only its rows of every batch, orbax checkpoints the sharded params and optimizer state
from every process, and process 0 alone prints and writes the report.

`--compare` repeats the same run (same seed, same initial params, same batches in the same order) with the
plain jnp / flax / optax baseline: implementation="xla" for every op, optax.contrib.galore and optax.adamw,
nn.Dense without FP8, optax's cross-entropy on the materialized logits. It prints both losses and the speed
ratio, and plots both curves together. With `--quantize`, the baseline's fine-tune quantizes its base the same
way, so the two differ in implementation only.

Attention is jax.nn.dot_product_attention, the same for both runs: `--attention xla|cudnn`, or by default cuDNN
on a GPU where a probe (forward and backward on one sequence of the model's shapes and dtype) works, else XLA;
the report says which ran and why. On an H200 the GPU preset's median step was 92 ms with XLA attention against
68 ms with cuDNN's (bf16; 84 / 56 ms with FP8 tensorwise; the cuDNN runs are benchmarks/results/example/step_*).

`--steps 0` skips pretraining (and its checkpoint): the fine-tune starts from the initial params, the cheap way
to measure the fine-tune alone (its step time, and its own peak memory: the report's peak is a process-wide
high-water mark, which pretraining would otherwise set).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the `llama` package beside this file
if importlib.util.find_spec("pallas_fused") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parent))

from llama import data, report  # noqa: E402
from llama import distributed as dist  # noqa: E402
from llama import mesh as mesh_lib  # noqa: E402
from llama.model import Llama, ModelConfig, block_kernel_mask, count_params  # noqa: E402
from llama.train import RunResult, loss_memory, train  # noqa: E402

from pallas_fused import adapt  # noqa: E402

# The fine-tune's DoRA goes on every block projection (the embedding and the output head stay as they are).
FINETUNE_PATHS = r"block_\d+/(attn/(q|k|v|o)|mlp/(gate|up|down))"

PRESETS = {
    # Tiny: the whole job (pretrain, checkpoint, fine-tune, plot) in a few minutes on 2 CPU cores.
    "cpu": dict(
        d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, seq_len=128, batch_size=16,
        steps=200, finetune_steps=80, lr=3e-3, finetune_lr=3e-3, warmup=20, galore_rank=32,
        update_proj_gap=50, dora_rank=8, dora_alpha=16.0, eval_every=25, val_batches=8,
        max_bytes=4_000_000, dtype="float32",
    ),
    # ~310M parameters, bf16 compute: 7 wide layers (d_model 2048, 16 heads of 128, 4 kv heads, SwiGLU 5504)
    # rather than 24 narrow ones, because compile time grows with depth (24 layers of 1024 took minutes)
    # and wide GEMMs are what the kernels are for.
    "gpu": dict(
        d_model=2048, n_layers=7, n_heads=16, n_kv_heads=4, d_ff=5504, seq_len=1024, batch_size=16,
        steps=300, finetune_steps=100, lr=3e-3, finetune_lr=1e-3, warmup=30, galore_rank=128,
        update_proj_gap=200, dora_rank=16, dora_alpha=32.0, eval_every=50, val_batches=8,
        max_bytes=None, dtype="bfloat16",
    ),
}


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")


def probe_cudnn_attention(s: dict) -> None:
    """Run cuDNN attention forward and backward on one sequence of the model's heads, head dim, length and dtype
    (batch 1: small next to a training step); raises whatever it raises where it does not work here (no cuDNN, a
    dtype or head dim it does not take, a jax without it)."""
    dtype, head_dim = jnp.dtype(s["dtype"]), s["d_model"] // s["n_heads"]
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(key_q, (1, s["seq_len"], s["n_heads"], head_dim), dtype)
    k = jax.random.normal(key_k, (1, s["seq_len"], s["n_kv_heads"], head_dim), dtype)
    v = jax.random.normal(key_v, (1, s["seq_len"], s["n_kv_heads"], head_dim), dtype)

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    if not all(bool(jnp.all(jnp.isfinite(g))) for g in grads):
        raise FloatingPointError("cuDNN attention gave non-finite gradients on the probe's input")


def choose_attention(requested: str | None, s: dict, *, gpu: bool | None = None,
                     probe=None) -> tuple[str, str]:
    """(the attention implementation to run, why): `requested` when given (--attention); otherwise cuDNN on a GPU
    where `probe(s)` (default probe_cudnn_attention) runs without error, else XLA. A CPU keeps XLA without probing.
    In a multi-process job the processes agree: cuDNN only if the probe passed on every one of them (they must run
    one program)."""
    if requested is not None:
        if requested not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"--attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {requested!r}")
        return requested, f"--attention {requested}"
    gpu = has_gpu() if gpu is None else gpu
    probe = probe_cudnn_attention if probe is None else probe
    failure = None
    if gpu:
        try:
            probe(s)
        except Exception as err:  # any failure of the probe means: do not use cuDNN here
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            failure = f"{type(err).__name__}: {first_line}"
    passed = dist.all_processes(gpu and failure is None)
    if passed:
        return "cudnn", f"default: cuDNN, its probe passed at {s['dtype']}, head dim {s['d_model'] // s['n_heads']}"
    if not gpu:
        return "xla", "default: XLA (no GPU)"
    if failure is None:
        return "xla", "default: XLA (cuDNN's probe failed on another process)"
    return "xla", f"default: XLA (cuDNN's probe failed: {failure})"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model/data size (default: gpu if a GPU is visible, else cpu)")
    p.add_argument("--steps", type=int, help="pretraining steps (0 skips pretraining: fine-tune the initial params)")
    p.add_argument("--finetune-steps", type=int, help="DoRA fine-tuning steps (0 skips the fine-tune)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--implementation", choices=["pallas", "xla", "interpret"], default=None,
                   help="for every pallas_fused op (default: pallas on a GPU, the XLA reference on CPU)")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"], default=None,
                   help="FP8 recipe for the block projections while pretraining")
    p.add_argument("--dora-rank", type=int, help="rank of the DoRA adapters for the fine-tune")
    p.add_argument("--quantize", choices=["int8", "nf4"], default=None,
                   help="QDoRA: the fine-tune's frozen block projection kernels quantized to int8 (per-column "
                        "scales) or NF4 (default: kept as they are)")
    p.add_argument("--compare", action="store_true", help="also run the plain jnp/flax/optax baseline")
    p.add_argument("--optimizer", choices=["galore_adamw", "adamw"], default="galore_adamw",
                   help="pretraining optimizer of pallas_fused (adamw: the fused AdamW on every param)")
    p.add_argument("--state-bits", type=int, choices=[32, 8], default=32,
                   help="Adam moments of pallas_fused's fused AdamW (pretraining with --optimizer adamw, and the "
                        "fine-tune): 8 = blockwise 8-bit states")
    p.add_argument("--out", type=pathlib.Path, default=None, help="output dir (default runs/<timestamp>)")
    p.add_argument("--ckpt-dir", type=pathlib.Path, default=None, help="checkpoint dir (default <out>/checkpoints)")
    p.add_argument("--projector", choices=["svd", "randomized"], default="randomized",
                   help="GaLore projector refresh for pallas_fused (the baseline uses optax.contrib.galore's SVD)")
    p.add_argument("--optax-path", action="store_true",
                   help="use galore_adamw's optax update + apply_updates instead of its in-place step")
    p.add_argument("--attention", choices=list(ATTENTION_IMPLEMENTATIONS), default=None,
                   help="jax.nn.dot_product_attention implementation, the same for both runs (default: cuDNN on a "
                        "GPU where a probe of it at the model's shapes works, else XLA; the report says which ran)")
    p.add_argument("--mesh", default=None, metavar="data=N|fsdp=N",
                   help="train on a device mesh: data=N (data parallel), fsdp=N (FSDP), or data=A,fsdp=B")
    p.add_argument("--no-progress", action="store_true", help="plain progress lines instead of a tqdm bar (for logs)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="start jax.distributed with this coordinator (process 0's address); with --num-processes "
                        "and --process-id. Under Slurm / Open MPI the launcher's settings are detected instead")
    p.add_argument("--num-processes", type=int, default=None, help="processes in the job (with --coordinator)")
    p.add_argument("--process-id", type=int, default=None, help="this process' index (with --coordinator)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (params stay fp32)")
    for key in ("batch_size", "seq_len", "lr", "galore_rank", "update_proj_gap", "eval_every", "n_layers", "d_model",
                "max_bytes"):
        p.add_argument("--" + key.replace("_", "-"), type=type(PRESETS["cpu"][key]), default=None,
                       help="override the preset")
    args = p.parse_args(argv)
    try:
        args.mesh_axes = mesh_lib.parse(args.mesh)
        # Before anything asks jax for a device: the distributed runtime must come up first.
        args.distributed = dist.initialize(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        p.error(str(e))
    if args.distributed and not args.mesh_axes:
        args.mesh_axes = {"data": jax.device_count()}  # every process' devices take part in every step
    args.preset = args.preset or ("gpu" if has_gpu() else "cpu")
    settings = dict(PRESETS[args.preset])
    overrides = {"steps": args.steps, "finetune_steps": args.finetune_steps, "dora_rank": args.dora_rank,
                 "dtype": args.dtype}
    overrides.update({k: getattr(args, k) for k in ("batch_size", "seq_len", "lr", "galore_rank", "update_proj_gap",
                                                   "eval_every", "n_layers", "d_model", "max_bytes")})
    settings.update({k: v for k, v in overrides.items() if v is not None})
    finetune = settings["finetune_steps"] > 0 and bool(settings["dora_rank"])
    if args.quantize and not finetune:
        p.error(f"--quantize {args.quantize} quantizes the DoRA fine-tune's base weights: it needs a fine-tune "
                f"(--finetune-steps > 0 and --dora-rank > 0; got {settings['finetune_steps']} and "
                f"{settings['dora_rank']})")
    if settings["steps"] < 0 or settings["finetune_steps"] < 0:
        p.error(f"--steps and --finetune-steps must be >= 0, got {settings['steps']} and {settings['finetune_steps']}")
    if settings["steps"] == 0 and not finetune:
        p.error("--steps 0 skips pretraining: it needs a fine-tune (--finetune-steps > 0 and --dora-rank > 0)")
    args.settings = settings
    args.attention, args.attention_reason = choose_attention(args.attention, settings)
    if args.out is None:  # process 0's clock names it, so every process writes its checkpoint shards there
        stamp = dist.broadcast_int(int(datetime.datetime.now().strftime("%Y%m%d%H%M%S")))
        args.out = pathlib.Path("runs") / datetime.datetime.strptime(str(stamp), "%Y%m%d%H%M%S").strftime(
            "%Y%m%d-%H%M%S")
    return args


def model_config(s: dict, *, implementation, fp8=None, attention=None, fused_loss=False) -> ModelConfig:
    return ModelConfig(
        d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
        d_ff=s["d_ff"], dtype=jnp.dtype(s["dtype"]), implementation=implementation, fp8=fp8, attention=attention,
        fused_loss=fused_loss,
    )


def finetune_model(s: dict, *, implementation, quantize=None, attention=None, fused_loss=False):
    """The pretrained model with DoRA on its block projections, applied by rule as to a model someone else wrote
    (`pallas_fused.adapt`); with `quantize` ("int8" / "nf4") their frozen kernels are stored quantized (QDoRA)."""
    rule = adapt.DoraRule(module_path=FINETUNE_PATHS, rank=s["dora_rank"], alpha=s["dora_alpha"], quantize=quantize,
                          implementation=implementation)
    cfg = model_config(s, implementation=implementation, attention=attention, fused_loss=fused_loss)
    return adapt.apply(Llama(cfg), [rule])


def schedule(lr: float, warmup: int, steps: int):
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2), lr * 0.1)


def pretrain_optimizer(s: dict, params, *, baseline: bool, implementation, projector: str, inplace: bool,
                       optimizer: str = "galore_adamw", state_bits: int = 32):
    """GaLore on the block projection kernels, plain Adam on everything else; the same numbers for both runs.

    pallas_fused runs `galore_adamw` with convention="optax" (optax.contrib.galore's projector side and eps
    placement), so the two runs differ only in the kernels and, with projector="randomized", in how the
    projector is refreshed. With `inplace`, the optimizer writes the params itself (galore_adamw_inplace).
    optimizer="adamw": pallas_fused's fused AdamW on every param instead (`state_bits` 8: 8-bit moments).
    """
    lr = schedule(s["lr"], s["warmup"], s["steps"])
    if optimizer == "adamw" and not baseline:
        from pallas_fused.adam import adamw

        return adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, state_bits=state_bits,
                     implementation=implementation)
    mask = block_kernel_mask(params, s["galore_rank"])
    common = dict(rank=s["galore_rank"], update_proj_gap=s["update_proj_gap"], scale=0.25, weight_decay=0.0)
    if baseline:
        from optax.contrib import GaLoreDimensionNumbers

        dims = jax.tree.map(lambda m: GaLoreDimensionNumbers() if m else None, mask)
        return optax.contrib.galore(lr, **common, base_optimizer=optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                                    weight_dimension_numbers=lambda _: dims)
    from pallas_fused.galore import galore_adamw, galore_adamw_inplace

    make = galore_adamw_inplace if inplace else galore_adamw
    return make(lr, **common, b1=0.9, b2=0.999, eps=1e-8, mask=mask, projector=projector, convention="optax",
                implementation=implementation)


def host_refresh_every(s: dict, *, baseline: bool, optimizer: str = "galore_adamw") -> int | None:
    """pallas_fused's GaLore refreshes its projectors on steps the loop names (`refresh=` every update_proj_gap
    steps), so the steps between refreshes hold no conditional (on a GPU, a conditional's predicate is read back
    by the host mid-step, and the launches after it wait). optax.contrib.galore decides on the device: None."""
    return None if baseline or optimizer != "galore_adamw" else s["update_proj_gap"]


def finetune_optimizer(s: dict, *, baseline: bool, implementation, state_bits: int = 32):
    lr = schedule(s["finetune_lr"], s["warmup"], s["finetune_steps"])
    if baseline:
        return optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    from pallas_fused.adam import adamw

    return adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, state_bits=state_bits,
                 implementation=implementation)


def save_checkpoint(path: pathlib.Path, tree) -> None:
    """Every process calls it: orbax writes each process' own shards (path on a filesystem all can see)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path.resolve(), tree, force=True)
    checkpointer.wait_until_finished()


def restore_checkpoint(path: pathlib.Path, like):
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    return ocp.StandardCheckpointer().restore(path.resolve(), abstract)


def trees_equal(a, b) -> bool:
    same = jax.tree.map(lambda x, y: x.shape == y.shape and x.dtype == y.dtype and bool(jnp.array_equal(x, y)), a, b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


def dora_params(ft_model, pretrained, key):
    """Pretrained params -> the DoRA fine-tune's (`adapt.from_pretrained`): every block projection's kernel kept
    (quantized with --quantize), beside it kernel_lora_a, kernel_lora_b = 0 and kernel_magnitude = ||W|| (of the
    quantized kernel with --quantize), so the fine-tune starts out computing what the pretrained model does (on
    its quantized weights)."""
    sample = jnp.zeros((1, 8), jnp.int32)  # init only needs the shapes
    return adapt.from_pretrained(ft_model, ft_model.init(key, sample), {"params": pretrained})["params"]


def adapter_keys(params) -> set[tuple[str, ...]]:
    """The flattened keys of the adapters (`adapt.trainable`): what the fine-tune trains."""
    from flax import traverse_util

    mask = traverse_util.flatten_dict(adapt.trainable(params))
    return {k for k, m in mask.items() if all(jax.tree.leaves(m))}


def fingerprints(params):
    """Cheap per-param fingerprints (sum and sum of squares in fp32 of each of its arrays: a quantized kernel
    has several) to see which params a run changed."""
    from flax import traverse_util

    def one(v):
        return jnp.stack([s for x in jax.tree.leaves(v) for s in (jnp.sum(x.astype(jnp.float32)),
                                                                  jnp.sum(jnp.square(x.astype(jnp.float32))))])

    return {k: one(v) for k, v in traverse_util.flatten_dict(params).items()}


def base_kernel_formats(params) -> list[str]:
    """How the block projection kernels are stored: "int8" / "nf4" (QDoRA) or their dtype name."""
    from flax import traverse_util

    from pallas_fused.dora.quant import Int8Kernel, NF4Kernel

    names = {Int8Kernel: "int8", NF4Kernel: "nf4"}
    return sorted({names[type(v.kernel)] if isinstance(v, adapt.QuantizedWeight) else str(v.dtype)
                   for k, v in traverse_util.flatten_dict(params).items()
                   if k[0].startswith("block_") and k[-1] == "kernel"})


def tree_fingerprint(tree) -> dict[str, list[float]]:
    """{leaf path: [sum, sum of |x|, sum of squares]} of any pytree (optimizer states included), as Python
    floats: comparable across processes and runs."""

    def one(v):
        v = v.astype(jnp.float32)
        return jnp.stack([jnp.sum(v), jnp.sum(jnp.abs(v)), jnp.sum(jnp.square(v))])

    sums = jax.jit(lambda t: jax.tree.map(one, t))
    flat = jax.tree_util.tree_flatten_with_path(sums(tree))[0]
    return {jax.tree_util.keystr(path): [float(x) for x in np.asarray(v)] for path, v in flat}


def changed_leaves(before, after) -> list[str]:
    return sorted("/".join(k) for k in before if not bool(jnp.array_equal(before[k], after[k])))


def run_variant(name: str, args, s: dict, init_params, batches: dict) -> tuple[list[RunResult], dict]:
    """Pretrain, checkpoint, restore, DoRA fine-tune: one variant ("pallas_fused" or "baseline"). With
    s["steps"] 0 the fine-tune starts from `init_params` (no pretraining, no checkpoint)."""
    baseline = name == "baseline"
    implementation = "xla" if baseline else args.implementation
    fp8 = None if baseline else args.fp8
    progress = None if not dist.is_main() else not args.no_progress
    checks: dict = {}
    layout = args.layout
    state_bits = 32 if baseline else args.state_bits

    results: list[RunResult] = []
    # The same initial params for both variants, a fresh device copy for each: the train step donates them.
    params = jax.tree.map(jnp.copy, init_params)
    if s["steps"] > 0:
        cfg = model_config(s, implementation=implementation, fp8=fp8, attention=args.attention, fused_loss=not baseline)
        model = Llama(cfg)
        tx = pretrain_optimizer(s, params, baseline=baseline, implementation=implementation, projector=args.projector,
                                inplace=not args.optax_path, optimizer=args.optimizer, state_bits=state_bits)
        params, opt_state, pre = train(name=name, phase="pretrain", model=model, params=params, tx=tx,
                                       is_trainable=lambda k: True, batches=batches["pretrain"],
                                       val_batches=batches["pretrain_val"], eval_every=s["eval_every"],
                                       progress=progress, layout=layout, batch_size=s["batch_size"],
                                       refresh_every=host_refresh_every(s, baseline=baseline, optimizer=args.optimizer))
        results.append(pre)

        # The whole training state: params and optimizer state (GaLore projectors and moments, 8-bit moments).
        ckpt = (args.ckpt_dir or args.out / "checkpoints") / name / "pretrain"
        # (Zero-size placeholder leaves, as in optax.contrib.galore's state, hold nothing and orbax refuses them.)
        state = jax.tree.map(lambda x: x if x.size else None, {"params": params, "opt_state": opt_state})
        save_checkpoint(ckpt, state)
        restored_state = restore_checkpoint(ckpt, state)
        checks["checkpoint"] = str(ckpt)
        checks["checkpoint_restored_identical"] = trees_equal(state, restored_state)
        checks["checkpoint_fingerprint"] = tree_fingerprint(restored_state)
        restored = restored_state["params"]
        del params, opt_state, state, restored_state
    else:  # no pretraining: the fine-tune starts from the initial params
        restored = params
        del params

    if s["finetune_steps"] > 0 and s["dora_rank"]:
        ft_model = finetune_model(s, implementation=implementation, quantize=args.quantize, attention=args.attention,
                                  fused_loss=not baseline)
        convert = jax.jit(lambda p, key: dora_params(ft_model, p, key))
        ft_params = convert(restored, jax.random.PRNGKey(args.seed + 1))
        del restored  # the full-precision params: with --quantize only the quantized base stays on the device
        checks["finetune_base_kernels"] = base_kernel_formats(ft_params)
        tx = finetune_optimizer(s, baseline=baseline, implementation=implementation, state_bits=state_bits)
        before = fingerprints(ft_params)
        adapters = adapter_keys(ft_params)
        ft_params, _, ft = train(name=name, phase="dora finetune", model=ft_model, params=ft_params, tx=tx,
                                 is_trainable=lambda k: k in adapters, batches=batches["finetune"],
                                 val_batches=batches["finetune_val"], eval_every=s["eval_every"],
                                 progress=progress, layout=layout, batch_size=s["batch_size"])
        changed = changed_leaves(before, fingerprints(ft_params))
        checks["finetune_changed"] = changed
        checks["finetune_only_adapters_changed"] = bool(changed) and all(
            tuple(c.split("/")) in adapters for c in changed)
        results.append(ft)
    return results, checks


def make_batches(s: dict, seed: int, rows: slice = slice(None)) -> dict:
    """Every batch of every phase, fixed up front from the seed (so both variants see the same data):
    `rows` of each global batch (this process' share; all of it in a single process)."""
    b, sl = s["batch_size"], s["seq_len"]
    streams = {name: data.load_split(name, max_bytes=s["max_bytes"]) for name in data.SPLITS}
    pre = data.Batches(streams["pretrain"], b, sl, seed, rows)
    ft = data.Batches(streams["finetune"], b, sl, seed + 1, rows)
    return {
        "pretrain": np.stack([next(pre) for _ in range(s["steps"])]) if s["steps"] else None,
        "finetune": np.stack([next(ft) for _ in range(s["finetune_steps"])]) if s["finetune_steps"] else None,
        "pretrain_val": data.eval_batches(streams["pretrain_val"], batch_size=b, seq_len=sl,
                                          num_batches=s["val_batches"], rows=rows),
        "finetune_val": data.eval_batches(streams["finetune_val"], batch_size=b, seq_len=sl,
                                          num_batches=s["val_batches"], rows=rows),
        "bytes": {name: int(len(v)) for name, v in streams.items()},
    }


def environment() -> dict:
    import flax

    from pallas_fused import _backend

    return {"device": _backend.device_name(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "python": sys.version.split()[0], "processes": jax.process_count(),
            "devices": jax.device_count()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    s = args.settings
    command = "python examples/train_llama.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                   else argv))
    from pallas_fused import _backend

    _backend.resolve_implementation(args.implementation, op="train_llama")  # fail now, not after loading data
    env = environment()
    echo = print if dist.is_main() else lambda *a, **k: None  # one voice for the whole job
    echo(f"preset {args.preset} on {env['device']} (jax {env['jax']}, {env['processes']} process(es), "
         f"{env['devices']} device(s)); output in {args.out}")
    echo(f"attention: {args.attention} ({args.attention_reason})")
    args.layout = mesh_lib.Layout.from_axes(args.mesh_axes) if args.mesh_axes else None
    rows = args.layout.process_rows(s["batch_size"]) if args.layout else slice(None)
    batches = make_batches(s, args.seed, rows)
    echo("corpus (bytes): " + ", ".join(f"{k} {v:,}" for k, v in batches["bytes"].items()))

    cfg = model_config(s, implementation="xla")
    init = jax.jit(lambda key, tokens: Llama(cfg).init(key, tokens)["params"])  # one compile, not one per op
    # Kept on the host: device memory then holds only what a phase trains, so the peak a phase reports is its own
    # (a fine-tune on a quantized base, say, shares the device with no full-precision copy of the model).
    init_params = jax.device_get(init(jax.random.PRNGKey(args.seed),
                                      jnp.asarray(batches["pretrain_val"][0][:1, :-1])))
    echo(f"model: {count_params(init_params) / 1e6:.1f}M params, {s['n_layers']} layers, d_model {s['d_model']}, "
          f"seq {s['seq_len']}, batch {s['batch_size']}, {s['dtype']}; fp8={args.fp8}, dora rank {s['dora_rank']}"
          + (f", {args.quantize} base" if args.quantize else ""))

    results, checks = [], {}
    for name in ["pallas_fused"] + (["baseline"] if args.compare else []):
        runs, checks[name] = run_variant(name, args, s, init_params, batches)
        results += runs

    quantized = f" on an {args.quantize} base (QDoRA)" if args.quantize else ""
    variants = {
        "pallas_fused": f"pallas_fused kernels (implementation={args.implementation or 'auto'}): rotary, embedding "
                        "(one-hot GEMM gradient), RMSNorm, SwiGLU, "
                        f"galore_adamw ({'optax path' if args.optax_path else 'in-place step'}, {args.projector} "
                        f"projector, refresh named by the loop), fused AdamW, DoRA by rule (adapt.DoraRule)"
                        f"{quantized}" + (
                            f", FP8 {args.fp8} block projections" if args.fp8
                            else ", bf16/fp32 nn.Dense block projections") + ", fused linear cross-entropy loss",
        "baseline": "plain jnp/flax/optax: implementation='xla' for rotary, SwiGLU and DoRA" + quantized
                    + ", nn.Embed, nn.RMSNorm, optax.contrib.galore (SVD projector), optax.adamw, nn.Dense, "
                    "optax cross-entropy on the logits",
    }
    settings = {**s, "preset": args.preset, "variants": variants, "seed": args.seed,
                "implementation": args.implementation, "fp8": args.fp8, "optax_path": args.optax_path,
                "projector": args.projector, "attention": args.attention,
                "attention_reason": args.attention_reason, "compare": args.compare,
                "quantize": args.quantize,
                "mesh": args.mesh_axes or None, "optimizer": args.optimizer, "state_bits": args.state_bits,
                "corpus_bytes": batches["bytes"], "num_params": count_params(init_params), "checks": checks}
    if not dist.is_main():
        return {"results": results, "checks": checks, "paths": None, "settings": settings}
    # What the fused loss saves, measured at this run's shapes (one device's share of the batch).
    settings["loss_memory"] = loss_memory(max(1, s["batch_size"] // jax.device_count()) * s["seq_len"],
                                          s["d_model"], cfg.vocab_size, jnp.dtype(s["dtype"]), args.implementation)
    report_settings = {**settings, "checks": {name: {k: v for k, v in c.items() if k != "checkpoint_fingerprint"}
                                              for name, c in checks.items()}}
    paths = report.write(args.out, results, command=command, settings=report_settings, environment=env)
    print()
    print(report.table(results, settings, env.get("device")))
    for line in report.comparison_lines(results) + report.loss_memory_lines(settings["loss_memory"]):
        print(line.removeprefix("- "))
    for name, c in checks.items():
        print(f"{name}: checkpoint restored identical: {c.get('checkpoint_restored_identical')}; "
              f"fine-tune changed only adapters: {c.get('finetune_only_adapters_changed')}; "
              f"base kernels: {c.get('finetune_base_kernels')}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"results": results, "checks": checks, "paths": paths, "settings": settings}


if __name__ == "__main__":
    main()
