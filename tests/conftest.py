"""Shared pytest setup: the `gpu` marker, the kernel implementation to test, float64 references, the order of
the tests."""

import os
import tempfile

# Mosaic GPU's interpret mode runs a kernel's warpgroups as threads whose barrier waits block inside host
# callbacks, which XLA runs on its CPU thread pool (NPROC threads, default the core count): with fewer pool threads
# than warpgroups that can wait at once (3 per CTA, 6 in a 2-CTA cluster), a 2-core machine deadlocks. Read when jax
# starts its CPU client.
os.environ["NPROC"] = str(max(8, int(os.environ.get("NPROC", 0)), os.cpu_count() or 1))
# The tests read the shipped tuning tables only, never a tuning cache the machine's user wrote (pallas_fused.tune):
# a directory no test writes to.
os.environ["PALLAS_FUSED_TUNING_CACHE"] = os.path.join(tempfile.gettempdir(), "pallas_fused_tests_no_tuning_cache")

import jax  # noqa: E402
import pytest
from hypothesis import HealthCheck, settings

from pallas_fused import _backend

jax.config.update("jax_enable_x64", False)

# Property tests that set no settings of their own: each interpret-mode example compiles its kernels (no
# per-example deadline, a few examples), and the same examples on every run.
settings.register_profile("pallas_fused", deadline=None, max_examples=10, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pallas_fused")

# The longest tests of the CPU suite (most CPU seconds first), started first: under `--dist worksteal` the other
# worker takes short tests from the end of the queue, so no worker is left running a long one alone at the end.
# The two multi-process tests stay adjacent so that one worker starts their module's single-process reference.
LONGEST_FIRST = (
    "tests/examples/test_multi_process.py::test_two_processes_match_one",
    "tests/examples/test_multi_process.py::test_four_processes_match_one",
    "tests/examples/test_train_llama_mesh.py::test_mesh_matches_one_device",
    "tests/test_multi_gpu_launch.py::test_launch_on_cpu_processes",
    "tests/sharding/test_optim_sharding.py::test_sharded_optimizer",
    "tests/examples/test_train_llama.py::test_compare_runs_baseline",
    "tests/examples/test_train_llama.py::test_pretrain_checkpoint_finetune_report",
    "tests/sharding/test_sharding.py::test_sharded",
    "tests/fp8/test_fp8.py::test_training_matches_bf16",
    "tests/examples/test_train_llama.py::test_model_kernels_keep_the_param_tree",
    "tests/test_docs.py::test_snippets_run",
    "tests/examples/test_profile_step.py::test_cpu_run_writes_table_and_json",
    "tests/test_fuzz.py::test_fuzz_dora_dense",
    "tests/test_fuzz.py::test_fuzz_galore",
    "tests/dora/test_dora.py::test_linen_bf16_and_qdora",
)


def pytest_addoption(parser):
    parser.addoption("--case-split", default=None, metavar="K/N",
                     help="run, of each parametrized test, the cases whose index is K modulo N (every test keeps at "
                          "least one case); unparametrized tests and `slow` cases always run. `make test`'s two legs "
                          "take 0/2 and 1/2, so every case runs on one jax version and every test on both (the newest "
                          "leg runs no `slow` case, so the floor leg runs them all).")


def parent_id(nodeid: str) -> str:
    """The test a case's id belongs to: the id without its parameters' "[...]" part."""
    return nodeid.partition("[")[0]


def parse_case_split(spec: str) -> tuple[int, int]:
    """--case-split's "K/N" -> (K, N); a pytest.UsageError naming the option otherwise."""
    try:
        k, n = (int(x) for x in spec.split("/"))
        if 0 <= k < n:
            return k, n
    except ValueError:
        pass
    raise pytest.UsageError(f"--case-split: expected K/N with 0 <= K < N, got {spec!r}")


def case_share(nodeids: list[str], always: list[bool], k: int, n: int) -> list[bool]:
    """Which of the test ids (in collection order) share K of N runs: of each test's cases (ids alike but for their
    "[...]" part) those whose index is K modulo N, or the last one where K is past their count, so every share runs
    every test; the `always` ones in every share, outside the count."""
    keep = list(always)
    cases: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        if not always[i]:
            cases.setdefault(parent_id(nodeid), []).append(i)
    for group in cases.values():
        for i in group[k::n] or group[-1:]:
            keep[i] = True
    return keep


def _case_split(config, items):
    """Deselect the cases that --case-split K/N leaves to another run (a `slow` case runs in every share: the newest
    leg, which takes the other share, runs none)."""
    spec = config.getoption("--case-split")
    if not spec:
        return
    keep = case_share([item.nodeid for item in items], ["slow" in item.keywords for item in items],
                      *parse_case_split(spec))
    dropped = [item for item, kept in zip(items, keep) if not kept]
    if dropped:
        items[:] = [item for item, kept in zip(items, keep) if kept]
        config.hook.pytest_deselected(items=dropped)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the split shares out the cases that would run
def pytest_collection_modifyitems(config, items):
    _case_split(config, items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(parent_id(item.nodeid), len(rank)))  # stable: the rest keep order
    if _backend.gpu_device() is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_impl() -> str:
    """The Pallas kernel as it runs here: compiled on a GPU, interpreted on the CPU."""
    return "pallas" if _backend.gpu_device() is not None else "interpret"
