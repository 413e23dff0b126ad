"""Multi-process training on JAX's distributed runtime: one process per host (or per GPU), one program.

    --coordinator HOST:PORT --num-processes N --process-id I    started by hand (or by any launcher)
    under Slurm / Open MPI / another launcher jax knows         detected, `jax.distributed.initialize()`

Every process runs the same program on the same global arrays (jax.Array spanning the processes' devices):
the mesh holds every device of every process, each process feeds only its own rows of each batch
(`jax.make_array_from_process_local_data`), orbax saves and restores the sharded state from every process,
and only process 0 writes the report.

`initialize` must run before anything touches a jax backend (jax.devices(), a first array).
"""

from __future__ import annotations

import os

import jax
import numpy as np

# Environment variables that say a cluster launcher started several tasks of this program; jax's own
# cluster detection (jax._src.clusters) then finds the coordinator, the process count and this process' id.
LAUNCHER_TASK_COUNTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launcher_detected(environ=None) -> bool:
    """Whether a cluster launcher started this program as one of several tasks."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    # Slurm exports SLURM_NTASKS inside an allocation too (salloc, sbatch's batch shell): only a job step
    # started by srun (SLURM_STEP_ID) is one task of several.
    if "SLURM_NTASKS" in environ and "SLURM_STEP_ID" not in environ:
        return False
    return any(environ.get(name, "1").isdigit() and int(environ.get(name, "1")) > 1 for name in LAUNCHER_TASK_COUNTS)


def use_cpu_collectives() -> None:
    """Cross-process collectives between CPU devices go through gloo (jax's CPU default does none)."""
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Start the distributed runtime if asked (`coordinator`) or launched as one task of several;
    returns whether it runs (it stays up for the life of the process: a second call reuses it).
    Explicit arguments: all three or none."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id: give all three or none "
                         f"(got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                         f"process_id={process_id!r})")
    if not all(given) and not launcher_detected():
        return False
    if jax.distributed.is_initialized():
        return True
    if all(given) and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    use_cpu_collectives()
    if all(given):
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    else:
        jax.distributed.initialize()
    return True


def is_main() -> bool:
    return jax.process_index() == 0


def broadcast_int(value: int) -> int:
    """Process 0's `value` on every process (e.g. a timestamp that names the output directory)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def all_processes(flag: bool) -> bool:
    """Whether `flag` holds on every process (a choice each process makes on its own, that all must share)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(bool(flag)))))


def put_global(tree, shardings):
    """Lay out `tree` (values identical on every process) with `shardings` (global NamedShardings).

    One process: `jax.device_put`. Several: a process-local value goes through host memory (each process
    keeps the shards of its own devices); a global array (already spanning the processes) is resharded."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree.map(one, tree, shardings)
