"""Device meshes for the example: `--mesh data=N` (data parallel), `--mesh fsdp=N` (FSDP), or both.

    data=N      the batch is split over N devices; params and optimizer states are replicated (each device
                computes the gradient of its slice of the batch, XLA all-reduces it).
    fsdp=N      the batch is split over the N devices too, and every 2-D weight, its gradient and its
                optimizer state are split along one axis (rows if N divides them, else columns): XLA gathers
                a weight for the forward/backward computation and reduce-scatters its gradient; the
                pallas_fused optimizers then step each device's shard in place (no gather).
    data=A,fsdp=B   both: the batch over A * B devices, the weights over the B devices of the fsdp axis.

Everything is ordinary jax.sharding: a `Mesh`, `NamedSharding`s, and `jax.jit(in_shardings=,
out_shardings=)`; the pallas_fused kernels partition themselves under it (pallas_fused._sharding).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp")


def parse(text: str | None) -> dict[str, int]:
    """'data=2' / 'fsdp=4' / 'data=2,fsdp=2' -> {name: size} (in the order given); None or '' -> {}."""
    if not text:
        return {}
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in AXES or not size.strip().isdigit() or int(size) < 1 or name in axes:
            raise ValueError(f"--mesh: expected comma-separated NAME=N with NAME in {AXES} (each once), got {text!r}")
        axes[name] = int(size)
    return axes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the example's arrays live on a mesh."""

    mesh: Mesh

    @classmethod
    def from_axes(cls, axes: dict[str, int]) -> Layout:
        n = math.prod(axes.values())
        if n > jax.device_count():
            raise ValueError(f"--mesh {axes} needs {n} devices, {jax.device_count()} visible")
        if jax.process_count() > 1 and n != jax.device_count():
            # Every process must take part in every step: the mesh holds all of their devices.
            raise ValueError(f"--mesh {axes} has {n} devices; with {jax.process_count()} processes it must "
                             f"hold all {jax.device_count()}")
        devices = np.array(jax.devices()[:n]).reshape(tuple(axes.values()))
        return cls(Mesh(devices, tuple(axes)))

    @property
    def fsdp(self) -> int:
        return self.mesh.shape.get("fsdp", 1)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch(self, leading: int = 0) -> NamedSharding:
        """A token batch (B, S + 1), after `leading` stacked axes: B split over every mesh axis."""
        return NamedSharding(self.mesh, P(*([None] * leading), tuple(self.mesh.axis_names)))

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.mesh.size:
            raise ValueError(f"batch size {batch_size} must be a multiple of the mesh's {self.mesh.size} devices")

    def process_rows(self, batch_size: int) -> slice:
        """The rows of a global batch that this process' devices hold (one contiguous block: the mesh
        orders devices by process, and the batch is split over every mesh axis)."""
        self.check_batch(batch_size)
        index_map = self.batch().addressable_devices_indices_map((batch_size, 1))
        rows = sorted({(idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
                       for idx in index_map.values()})
        if any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
            raise ValueError(f"this process' devices hold rows {rows} of the batch: not one contiguous block")
        return slice(rows[0][0], rows[-1][1])

    def global_batch(self, local: np.ndarray, batch_size: int, leading: int = 0) -> jax.Array:
        """One global batch (axis `leading` of size `batch_size`) from this process' rows of it."""
        shape = local.shape[:leading] + (batch_size,) + local.shape[leading + 1:]
        return jax.make_array_from_process_local_data(self.batch(leading), local, shape)

    def param(self, x) -> NamedSharding:
        """FSDP: a 2-D weight split along its rows if the fsdp axis divides them, else its columns; the rest
        (and everything without an fsdp axis) replicated."""
        n = self.fsdp
        if n > 1 and np.ndim(x) == 2:
            rows, cols = x.shape
            if rows % n == 0:
                return NamedSharding(self.mesh, P("fsdp", None))
            if cols % n == 0:
                return NamedSharding(self.mesh, P(None, "fsdp"))
        return self.replicated

    def params(self, tree):
        return jax.tree.map(self.param, tree)

    def opt_state(self, state, param_shardings):
        """The optimizer state laid out like its params: pallas_fused's states through their
        `state_shardings` helpers; any other state (the optax baseline) replicated."""
        from pallas_fused.adam import FusedAdamState
        from pallas_fused.adam import state_shardings as adam_shardings
        from pallas_fused.galore import GaLoreAdamState
        from pallas_fused.galore import state_shardings as galore_shardings

        def one(x):
            if isinstance(x, GaLoreAdamState):
                return galore_shardings(x, param_shardings)
            if isinstance(x, FusedAdamState):
                return adam_shardings(x, param_shardings)
            return self.replicated

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, (GaLoreAdamState, FusedAdamState)))
