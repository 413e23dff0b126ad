"""A real corpus that every machine has offline: the Python standard library's own source files.

Files are `*.py` under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), sorted by path, read as
bytes: the tokens are the bytes themselves (vocab 256), files joined by a NUL byte (never in Python source)
as the document separator. Every file goes to exactly one split, decided by a hash of its relative path,
so the split is the same on every run and every machine with the same Python:

    "pretrain"      the pretraining text (everything not below)
    "pretrain_val"  held-out files for the pretraining validation loss (~5% of files)
    "finetune"      the slice the DoRA fine-tune trains on: the test suites (paths with a test/tests
                    directory or a test_*.py name), a different kind of text from library code
    "finetune_val"  held-out test-suite files (~10% of them)
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig
import zlib
from dataclasses import dataclass, field

import numpy as np

VOCAB_SIZE = 256
SEPARATOR = 0  # NUL: never appears in Python source, marks a file boundary

SPLITS = ("pretrain", "pretrain_val", "finetune", "finetune_val")


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_test_file(rel: pathlib.PurePath) -> bool:
    return any(part in ("test", "tests", "idle_test") or part.startswith("test_") for part in rel.parts)


def split_of(rel: pathlib.PurePath) -> str:
    """The split a file (path relative to the stdlib root) belongs to; deterministic."""
    bucket = zlib.crc32(rel.as_posix().encode()) % 100
    if _is_test_file(rel):
        return "finetune_val" if bucket < 10 else "finetune"
    return "pretrain_val" if bucket < 5 else "pretrain"


def list_files(root: pathlib.Path | None = None) -> dict[str, list[pathlib.Path]]:
    """Every stdlib `*.py` file, sorted, grouped by split."""
    return {name: list(paths) for name, paths in _list_files(root or stdlib_root()).items()}


@functools.cache  # walking the stdlib takes seconds; every split (and every run in one process) reuses it
def _list_files(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, ...]]:
    files: dict[str, list[pathlib.Path]] = {name: [] for name in SPLITS}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        files[split_of(rel)].append(path)
    return {name: tuple(paths) for name, paths in files.items()}


def load_split(name: str, *, max_bytes: int | None = None, root: pathlib.Path | None = None) -> np.ndarray:
    """One split as a flat uint8 token stream (files in sorted order, NUL between files).

    `max_bytes` keeps only the first files, up to that many bytes (the CPU preset does not need 20 MB).
    """
    if name not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
    chunks, total = [], 0
    for path in list_files(root)[name]:
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file changes nothing about the rest of the corpus
            continue
        chunks.append(data + bytes([SEPARATOR]))
        total += len(chunks[-1])
        if max_bytes is not None and total >= max_bytes:
            break
    stream = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return stream[:max_bytes] if max_bytes is not None else stream


@dataclass
class Batches:
    """Random windows of `seq_len + 1` tokens from a stream, in an order fixed by `seed`.

    Two runs with the same seed see the same batches in the same order (the `--compare` baseline
    relies on it). Batches are (batch_size, seq_len + 1) int32: inputs are [:, :-1], targets [:, 1:].
    `rows` keeps only those rows of every batch (one process' share of the global batch): the same windows
    as the full batch's rows, since every start is drawn either way.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    rows: slice = field(default_factory=lambda: slice(None))

    def __post_init__(self):
        if len(self.tokens) < self.seq_len + 2:
            raise ValueError(f"tokens: need more than seq_len + 1 = {self.seq_len + 1} tokens, got {len(self.tokens)}")
        self._rng = np.random.default_rng(self.seed)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)[self.rows]
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int,
                 rows: slice = slice(None)) -> np.ndarray:
    """A fixed validation set: evenly spaced windows over the held-out stream, (num_batches, B, S + 1);
    `rows`: only those rows of each batch."""
    count = batch_size * num_batches
    span = len(tokens) - seq_len - 1
    if span <= 0:
        raise ValueError(f"tokens: validation stream of {len(tokens)} tokens is shorter than seq_len + 1")
    starts = np.linspace(0, span, count).astype(np.int64).reshape(num_batches, batch_size)[:, rows]
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts.reshape(-1)]).astype(np.int32)
    return windows.reshape(num_batches, starts.shape[1], seq_len + 1)
