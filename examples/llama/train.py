"""The training loop: one jitted, donated train step; a fixed validation set; honest timing.

The train state holds the params in two parts, `trainable` and `frozen` (empty when pretraining;
the base weights when fine-tuning with DoRA): gradients and the optimizer only ever see `trainable`,
so a frozen weight gets no gradient, no optimizer state and no update.

Timing: the steps that compile a program (the first; with a host-decided GaLore refresh, also the first without
a refresh) and the validation passes are excluded; every other step counts, projector refreshes included. The
loop blocks only at log and eval points, so dispatch runs ahead.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from .distributed import put_global
from .model import count_params


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    trainable: Any
    frozen: Any
    opt_state: Any


def split_params(params, is_trainable: Callable[[tuple[str, ...]], bool]):
    """Split a params tree into (trainable, frozen) trees by a predicate on each leaf's key path."""
    flat = traverse_util.flatten_dict(params)
    trainable = {k: v for k, v in flat.items() if is_trainable(k)}
    frozen = {k: v for k, v in flat.items() if not is_trainable(k)}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def merge_params(trainable, frozen):
    flat = traverse_util.flatten_dict(trainable)
    flat.update(traverse_util.flatten_dict(frozen))
    return traverse_util.unflatten_dict(flat)


def loss_fn(model, params, batch):
    """Mean next-byte cross-entropy (nats per byte) of a (B, S + 1) token batch."""
    return model.apply({"params": params}, batch[:, :-1], batch[:, 1:])


def loss_memory(tokens: int, d_model: int, vocab: int, dtype, implementation=None) -> dict[str, int | None]:
    """Bytes of temporaries XLA plans for the head and its loss, forward and backward, at `tokens` x `d_model`:
    "fused" (pallas_fused.loss.linear_cross_entropy, which never writes the logits) and "materialized" (logits, then
    optax's cross-entropy, as the baseline computes it); None where the backend gives no memory analysis."""
    from pallas_fused.loss import linear_cross_entropy

    def materialized(hidden, kernel, labels):
        logits = (hidden @ kernel.astype(hidden.dtype)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def fused(hidden, kernel, labels):
        # The Dense kernel's (d, vocab) layout, said rather than read from the shape: a model as wide as its
        # vocabulary (d_model 256 over bytes) has a square kernel.
        return linear_cross_entropy(hidden, kernel, labels, weight_layout="dv", implementation=implementation)

    args = (jax.ShapeDtypeStruct((tokens, d_model), dtype), jax.ShapeDtypeStruct((d_model, vocab), jnp.float32),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    out = {}
    for name, fn in (("fused", fused), ("materialized", materialized)):
        analysis = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis()
        out[name] = None if analysis is None else int(analysis.temp_size_in_bytes)
    return out


def make_train_step(model, tx, state_sharding=None, batch_sharding=None):
    """The whole step (forward, backward, optimizer, apply) as one jitted function; the state is donated.

    `tx` is an optax transformation (update + apply_updates) or an in-place optimizer with
    `step(params, grads, state) -> (params, state)` (pallas_fused.galore.galore_adamw_inplace).
    The step's static third argument `refresh` (None: not passed) goes to the optimizer: True on the steps that
    refresh GaLore's projectors, False on the others, so two programs are compiled and neither holds the on-device
    refresh conditional, whose predicate the host would otherwise read back in the middle of every step.
    On a mesh, `state_sharding` (a TrainState of shardings) and `batch_sharding` pin the step's layout:
    the state comes back exactly as it went in, so the next step reuses the compiled program.
    """

    def objective(trainable, frozen, batch):
        return loss_fn(model, merge_params(trainable, frozen), batch)

    shardings = {}
    if state_sharding is not None:
        shardings = dict(in_shardings=(state_sharding, batch_sharding),
                         out_shardings=(state_sharding, NamedSharding(batch_sharding.mesh, PartitionSpec())))

    # `refresh` is positional: jit takes no keyword arguments where in_shardings are given.
    @functools.partial(jax.jit, donate_argnums=0, static_argnums=2, **shardings)
    def train_step(state: TrainState, batch, refresh: bool | None = None):
        loss, grads = jax.value_and_grad(objective)(state.trainable, state.frozen, batch)
        extra = {} if refresh is None else {"refresh": refresh}
        if hasattr(tx, "step"):  # an in-place optimizer (e.g. galore_adamw_inplace): writes params itself
            trainable, opt_state = tx.step(state.trainable, grads, state.opt_state, **extra)
        else:
            updates, opt_state = tx.update(grads, state.opt_state, state.trainable, **extra)
            trainable = optax.apply_updates(state.trainable, updates)
        return state.replace(step=state.step + 1, trainable=trainable, opt_state=opt_state), loss

    return train_step


def place(state: TrainState, model, tx, layout, batch_size: int):
    """Put the state where it trains; returns (state, jitted train step, put) where put(rows, leading=0)
    turns this process' rows of a batch into the step's input.

    One device (layout None): everything committed to the first device (jit keys its cache on
    committed-ness, so a state of fresh, uncommitted arrays would compile the step a second time when its
    committed outputs come back). A `llama.mesh.Layout`: params and optimizer state laid out by it, the
    batch split over the mesh (each process gives its own rows), and the step jitted with those in/out
    shardings."""
    if layout is None:
        device = jax.devices()[0]
        return jax.device_put(state, device), make_train_step(model, tx), lambda rows, leading=0: jax.device_put(
            rows, device)
    layout.check_batch(batch_size)
    trainable_sh, frozen_sh = layout.params(state.trainable), layout.params(state.frozen)
    state_sh = TrainState(step=layout.replicated, trainable=trainable_sh, frozen=frozen_sh,
                          opt_state=layout.opt_state(state.opt_state, trainable_sh))

    def put(rows, leading=0):
        return layout.global_batch(rows, batch_size, leading)

    return put_global(state, state_sh), make_train_step(model, tx, state_sh, layout.batch()), put


def make_evaluate(model):
    """Mean loss over a stacked validation set (N, B, S + 1), one compiled scan."""

    @jax.jit
    def evaluate(params, batches):
        def body(total, batch):
            return total + loss_fn(model, params, batch), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), batches)
        return total / batches.shape[0]

    return evaluate


@dataclasses.dataclass
class RunResult:
    """What one training run produced: curves, final numbers and timing."""

    name: str
    phase: str
    train_steps: list[int] = dataclasses.field(default_factory=list)
    train_loss: list[float] = dataclasses.field(default_factory=list)
    val_steps: list[int] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    train_s: float = 0.0  # wall time of every step after the first, evaluation excluded
    timed_steps: int = 0
    windows: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (steps, seconds) per log window
    tokens_per_step: int = 0  # the global batch's tokens: every device's share together
    num_devices: int = 1  # devices the step ran on (the mesh's, across every process): MFU is per device
    num_params: int = 0
    num_trainable: int = 0
    opt_state_bytes: int = 0
    peak_bytes: int | None = None  # device 0's peak_bytes_in_use after the run (None where jax does not report it)

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.train_s / max(self.timed_steps, 1)

    @property
    def median_step_ms(self) -> float:
        """Median over log windows of ms per step: the typical step, a projector refresh's window aside."""
        per_step = [1000.0 * sec / n for n, sec in self.windows if n > 0]
        return float(np.median(per_step)) if per_step else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Global tokens / s over every timed step (all devices together)."""
        return self.tokens_per_step * self.timed_steps / max(self.train_s, 1e-9)

    @property
    def median_tokens_per_s(self) -> float:
        """Global tokens / s at the median step."""
        return self.tokens_per_step / (self.median_step_ms * 1e-3) if self.median_step_ms > 0 else 0.0

    def summary(self) -> dict:
        return {
            "name": self.name,
            "phase": self.phase,
            "steps": self.train_steps[-1] if self.train_steps else 0,
            "final_train_loss": self.train_loss[-1] if self.train_loss else None,
            "initial_val_loss": self.val_loss[0] if self.val_loss else None,
            "final_val_loss": self.val_loss[-1] if self.val_loss else None,
            "step_ms": self.step_ms,
            "median_step_ms": self.median_step_ms,
            "tokens_per_s": self.tokens_per_s,
            "median_tokens_per_s": self.median_tokens_per_s,
            "num_devices": self.num_devices,
            "compile_s": self.compile_s,
            "num_params": self.num_params,
            "num_trainable": self.num_trainable,
            "opt_state_bytes": self.opt_state_bytes,
            "peak_bytes": self.peak_bytes,
        }

    def to_json(self) -> dict:
        out = self.summary()
        out.update(train_steps=self.train_steps, train_loss=self.train_loss, val_steps=self.val_steps,
                   val_loss=self.val_loss)
        return out


def tree_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def peak_bytes_in_use() -> int | None:
    """Device 0's high-water mark of allocated bytes since the process started (jax has no reset), or None where
    the backend keeps no memory stats (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


class _NoProgress:
    """No progress output (every process but the first of a multi-process run)."""

    def __init__(self, total, desc, **_):
        self.n = 0

    def set_postfix(self, **kw):
        pass

    def update(self, k):
        self.n += k

    def close(self):
        pass


class _PlainProgress:
    """Plain progress lines (one per log window): for logs, or where tqdm is not installed."""

    def __init__(self, total, desc, **_):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, {}

    def set_postfix(self, **kw):
        self.postfix = kw

    def update(self, k):
        self.n += k
        print(f"{self.desc} {self.n}/{self.total} " + " ".join(f"{k}={v}" for k, v in self.postfix.items()),
              flush=True)

    def close(self):
        pass


def _progress_bar_class():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress
    return tqdm


def train(
    *,
    name: str,
    phase: str,
    model,
    params,
    tx,
    is_trainable: Callable[[tuple[str, ...]], bool],
    batches: np.ndarray,
    val_batches: np.ndarray,
    eval_every: int,
    log_every: int = 10,
    progress: bool | None = True,  # False: plain log lines instead of a tqdm bar; None: nothing
    layout=None,  # a llama.mesh.Layout: train on its device mesh (None: one device)
    batch_size: int | None = None,  # the global batch; `batches` holds this process' rows of it
    refresh_every: int | None = None,  # GaLore's projector refresh decided here: every this many steps, from 0
) -> tuple[Any, Any, RunResult]:
    """Train `params` on `batches` (steps, B, S + 1); returns the final params, the optimizer state and
    the run's record. With `refresh_every`, `tx` takes `refresh=` (pallas_fused's galore_adamw) and the loop
    passes True on steps 0, refresh_every, 2 refresh_every, ...: the step between refreshes holds no conditional."""
    bar_class = _NoProgress if progress is None else _progress_bar_class() if progress else _PlainProgress
    batch_size = batch_size or batches.shape[1]
    steps = len(batches)
    trainable, frozen = split_params(params, is_trainable)
    state = TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable, frozen=frozen,
                       opt_state=tx.init(trainable))
    del params, trainable, frozen  # the state owns them now (it is donated to every step)
    state, train_step, put = place(state, model, tx, layout, batch_size)

    def run_step(i):
        return train_step(state, put(batches[i]), None if refresh_every is None else i % refresh_every == 0)

    # Steps that compile a program are not timed: the first, and with refresh_every the first without a refresh.
    compiling = {0} if refresh_every in (None, 1) else {0, 1}
    evaluate = make_evaluate(model)
    val_batches = put(val_batches, leading=1)
    result = RunResult(name=name, phase=phase, tokens_per_step=int(batch_size * (batches.shape[2] - 1)),
                       num_devices=1 if layout is None else int(layout.mesh.size),
                       num_params=count_params((state.trainable, state.frozen)),
                       num_trainable=count_params(state.trainable),
                       opt_state_bytes=tree_bytes(state.opt_state))

    def validate(step):
        loss = float(evaluate(merge_params(state.trainable, state.frozen), val_batches))
        result.val_steps.append(step)
        result.val_loss.append(loss)
        return loss

    val = validate(0)
    bar = bar_class(total=steps, desc=f"{phase}:{name}", dynamic_ncols=True)
    pending: list[tuple[int, jax.Array]] = []
    window_start, window_steps = None, 0
    for i in range(steps):
        if i in compiling:
            start = time.perf_counter()
            state, loss = run_step(i)
            loss.block_until_ready()
            result.compile_s += time.perf_counter() - start
            pending.append((i + 1, loss))
            window_start = time.perf_counter()
        else:
            state, loss = run_step(i)
            pending.append((i + 1, loss))
            window_steps += 1
        done = i + 1
        if done % log_every == 0 or done % eval_every == 0 or done == steps:
            jax.block_until_ready(loss)
            elapsed = time.perf_counter() - window_start
            result.train_s += elapsed
            result.timed_steps += window_steps
            result.windows.append((window_steps, elapsed))
            for step, value in pending:
                result.train_steps.append(step)
                result.train_loss.append(float(value))
            pending.clear()
            if done % eval_every == 0 or done == steps:
                val = validate(done)
            tok_s = result.tokens_per_step * window_steps / elapsed if window_steps else 0.0
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}", val=f"{val:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update(done - bar.n)
            window_start, window_steps = time.perf_counter(), 0
    bar.close()
    result.peak_bytes = peak_bytes_in_use()
    return merge_params(state.trainable, state.frozen), state.opt_state, result
