"""Tuning data: the launch parameters and per-shape choices each op reads for this process' GPU.

A table is a JSON file of one GPU kind, `<device>.json` (`device_slug` of jax's `device_kind`), holding data only:

    {"schema": 1, "device_kind": "NVIDIA H200", "compute_capability": [9, 0], "num_sms": 132,
     "<section>": {...},                     # an op's launch parameters, read by `tuned(section, heuristic)`
     "shapes": {"<op>": {"<shape key>": {"choice": "<candidate>", "config": {...}, "ms": {"<candidate>": ms}}}}}

"shapes" holds what `pallas_fused.tune` measured: per op and shape, the winning candidate, its config, and the
time of every candidate timed (ms per call; null where one failed). The reasons behind the hand-tuned sections are
in docs/performance.md ("Tuning tables").

Lookups go through layers, the first that has an entry winning (key by key within a section):
  1. the user's cache, <cache dir>/<device>.json, written by `pallas_fused.tune` (the cache dir: `set_cache_dir`,
     else $PALLAS_FUSED_TUNING_CACHE, else $XDG_CACHE_HOME/pallas_fused, else ~/.cache/pallas_fused);
  2. the table shipped for this device kind, pallas_fused/tuning/<device>.json;
  3. the nearest shipped table of the same architecture (compute capability major) by SM count and memory
     bandwidth (`KNOWN_DEVICES`; an unknown device by its SM count alone): in place of a table this GPU kind lacks,
     and, for launch parameters, for the sections its own table lacks (a table the tuner wrote holds shapes only);
     per-shape choices come from it only where the GPU kind has no shipped table, as a table's shapes were chosen
     on its own GPU;
  4. the op's own heuristic.
A cache file that is not JSON, is of another device kind or another schema version is ignored with one warning.

Each file is read once per process (`reload` reads them again): the choice is a pure function of shapes, dtypes,
the device kind and these files. Every process of a multi-host job must see the same files, or the hosts would
compile different programs: `pallas_fused.tune` run in every process writes process 0's results on every host; a
cache file tuned elsewhere is copied to every host (or the cache dir shared) before the job starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pallas_fused import _devices

SCHEMA = 1
TUNING_DIR = Path(__file__).parent / "tuning"
CACHE_ENV = "PALLAS_FUSED_TUNING_CACHE"
SHAPES = "shapes"
# The header of a table: what it describes, not tuning data.
HEADER = ("schema", "device_kind", "compute_capability", "num_sms", "source", "written_by", "jax", "pallas_fused")


@dataclasses.dataclass(frozen=True)
class Device:
    """What the choice of a table goes by: the kind (jax's `device_kind`), compute capability, SMs, HBM TB/s."""

    kind: str
    compute_capability: tuple[int, int] | None = None
    num_sms: int | None = None
    hbm_tbps: float | None = None


# Datasheet figures of the GPUs a table may be chosen for: device_kind (or its start) -> (compute capability, SMs,
# HBM TB/s). A device kind matches the longest name it starts with.
KNOWN_DEVICES: dict[str, tuple[tuple[int, int], int, float]] = {
    "NVIDIA A100-SXM4-40GB": ((8, 0), 108, 1.56),
    "NVIDIA A100-SXM4-80GB": ((8, 0), 108, 2.04),
    "NVIDIA A100 80GB PCIe": ((8, 0), 108, 1.94),
    "NVIDIA H100 80GB HBM3": ((9, 0), 132, 3.35),  # H100 SXM
    "NVIDIA H100 PCIe": ((9, 0), 114, 2.0),
    "NVIDIA H100 NVL": ((9, 0), 132, 3.9),
    "NVIDIA H100": ((9, 0), 132, 3.35),
    "NVIDIA H200": ((9, 0), 132, 4.8),
    "NVIDIA H800 PCIe": ((9, 0), 114, 2.0),
    "NVIDIA H800": ((9, 0), 132, 3.35),
    "NVIDIA H20": ((9, 0), 78, 4.0),
    "NVIDIA GH200 144G HBM3e": ((9, 0), 132, 4.9),
    "NVIDIA GH200": ((9, 0), 132, 4.0),
}


def device_slug(kind: str) -> str:
    """A device kind as a file name: "NVIDIA H200" -> "nvidia_h200" (as benchmarks/results/<device>.json)."""
    return "".join(ch if ch.isalnum() else "_" for ch in kind.lower()).strip("_")


def describe(kind: str, compute_capability: tuple[int, int] | None = None, num_sms: int | None = None) -> Device:
    """A Device of `kind`: what is not given comes from KNOWN_DEVICES (the longest name `kind` starts with)."""
    names = [name for name in KNOWN_DEVICES if kind.startswith(name)]
    known = KNOWN_DEVICES[max(names, key=len)] if names else None
    cc = tuple(compute_capability) if compute_capability else known[0] if known else None
    return Device(kind, cc, num_sms or (known[1] if known else None), known[2] if known else None)


def current_device() -> Device | None:
    """This process' GPU as a Device, the CPU's device kind without the rest where it has none."""
    gpu = _devices.gpu_device()
    if gpu is None:
        import jax

        return Device(getattr(jax.devices()[0], "device_kind", "cpu"))
    major, _, minor = str(getattr(gpu, "compute_capability", "")).partition(".")
    cc = (int(major), int("".join(filter(str.isdigit, minor)) or 0)) if major.isdigit() else None
    return describe(gpu.device_kind, cc, getattr(gpu, "core_count", None))


# ----------------------------------------------------------------------------------------------
# reading tables

_cache_dir: list[Path] = []  # set_cache_dir's


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Read (and let `pallas_fused.tune` write) the user cache in `path` from now on; None: the default again."""
    _cache_dir[:] = [Path(path).expanduser()] if path is not None else []
    reload()


def cache_dir() -> Path:
    """The user cache's directory (see the module docstring)."""
    if _cache_dir:
        return _cache_dir[0]
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pallas_fused"


def check_table(data: Any, kind: str) -> str | None:
    """Why `data` is no table of device kind `kind`, or None where it is one."""
    if not isinstance(data, dict):
        return f"a JSON object was expected, got {type(data).__name__}"
    if data.get("schema") != SCHEMA:
        return f"schema version {data.get('schema')!r}, this pallas_fused reads {SCHEMA}"
    if data.get("device_kind") != kind:
        return f"it is the table of {data.get('device_kind')!r}, not of {kind!r}"
    for name, value in data.items():
        if name not in HEADER and not isinstance(value, dict):
            return f"section {name!r} must be a JSON object, got {type(value).__name__}"
    for op, entries in data.get(SHAPES, {}).items():
        for key, entry in entries.items() if isinstance(entries, dict) else [("", None)]:
            if not (isinstance(entry, dict) and isinstance(entry.get("choice"), str)
                    and isinstance(entry.get("config"), dict)):
                return f"shapes.{op}[{key!r}] must hold a 'choice' name and a 'config' object"
    return None


def read_table(path: Path, kind: str) -> dict[str, Any]:
    """The table at `path` for device kind `kind`; {} with one warning where it is unreadable or not such a table,
    {} without one where there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        warnings.warn(f"pallas_fused: tuning file {path} ignored: {err}", RuntimeWarning, stacklevel=2)
        return {}
    try:
        data = json.loads(text)
    except ValueError as err:
        warnings.warn(f"pallas_fused: tuning file {path} ignored: not JSON ({err})", RuntimeWarning, stacklevel=2)
        return {}
    why = check_table(data, kind)
    if why is not None:
        warnings.warn(f"pallas_fused: tuning file {path} ignored: {why}", RuntimeWarning, stacklevel=2)
        return {}
    return data


@functools.cache
def tuning_table(kind: str) -> Mapping[str, Any]:
    """The shipped table of one GPU kind (pallas_fused/tuning/<device>.json), or {} where none was measured."""
    return read_table(TUNING_DIR / f"{device_slug(kind)}.json", kind)


def shipped_devices() -> list[Device]:
    """The devices the package ships a table for, described by their tables' headers and KNOWN_DEVICES."""
    devices = []
    for path in sorted(TUNING_DIR.glob("*.json")):
        header = json.loads(path.read_text())
        devices.append(describe(header["device_kind"], header.get("compute_capability"), header.get("num_sms")))
    return devices


def nearest(device: Device, candidates: list[Device]) -> Device | None:
    """The candidate of `device`'s architecture (compute capability major) nearest to it: the smallest sum of
    relative differences in SM count and in memory bandwidth (where both are known), then the name; None where
    none shares the architecture."""
    if device.compute_capability is None:
        return None

    def distance(other: Device) -> tuple[float, str]:
        d = 0.0
        if device.num_sms and other.num_sms:
            d += abs(other.num_sms - device.num_sms) / device.num_sms
        if device.hbm_tbps and other.hbm_tbps:
            d += abs(other.hbm_tbps - device.hbm_tbps) / device.hbm_tbps
        return d, other.kind

    same = [c for c in candidates if c.compute_capability is not None and c.kind != device.kind
            and c.compute_capability[0] == device.compute_capability[0]]
    return min(same, key=distance) if same else None


@functools.cache
def layers(device: Device, cache: Path) -> tuple[tuple[Mapping[str, Any], ...], tuple[Mapping[str, Any], ...]]:
    """The tables `device` reads, first hit first: (for sections, for shapes). Its cache file in `cache`, its
    shipped table, then the nearest shipped one (module docstring): for shapes only where the device has no shipped
    table (a table of its own chose its shapes), for sections also to fill the sections its own lacks (a table the
    tuner wrote holds shapes only). Read once per (device, cache dir) per process."""
    cached = read_table(cache / f"{device_slug(device.kind)}.json", device.kind)
    own = tuning_table(device.kind)
    near = nearest(device, shipped_devices())
    near_table = tuning_table(near.kind) if near is not None else {}
    sections = tuple(t for t in (cached, own, near_table) if t)
    shapes = tuple(t for t in (cached, own or near_table) if t)
    return sections, shapes


def reload() -> None:
    """Read the tuning files again at the next lookup (after a tuner wrote the cache)."""
    layers.cache_clear()
    tuning_table.cache_clear()


def active_layers() -> tuple[tuple[Mapping[str, Any], ...], tuple[Mapping[str, Any], ...]]:
    device = current_device()
    return layers(device, cache_dir()) if device is not None else ((), ())


def tuned(section: str, heuristic: Mapping[str, Any]) -> dict[str, Any]:
    """`section` of this process' tables over `heuristic` (the op's guess, for entries no table has)."""
    merged = dict(heuristic)
    for table in reversed(active_layers()[0]):
        merged.update(table.get(section, {}))
    return merged


# ----------------------------------------------------------------------------------------------
# per-shape choices, and recording which ones a function makes

_recorders: list[list[tuple[str, str]]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """Collects the (op, shape key) of every `choice` looked up inside, in first-seen order, once each."""
    seen: list[tuple[str, str]] = []
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def choice(op: str, key: str) -> Mapping[str, Any] | None:
    """The entry {"choice", "config", "ms"} of `op` at shape `key` in the first table that has one, else None (the
    op's own rule decides). Ops call it while they are traced, so `recording` sees each lookup."""
    for seen in _recorders:
        if (op, key) not in seen:
            seen.append((op, key))
    for table in active_layers()[1]:
        entry = table.get(SHAPES, {}).get(op, {}).get(key)
        if entry is not None:
            return entry
    return None


@dataclasses.dataclass(frozen=True)
class Tunable:
    """What the tuner needs of an op whose choice is per shape.

    candidates(key) -> {name: config}: the configurations worth timing at shape `key` (JSON data), the op's
        untuned choice first (the tuner keeps it on a tie);
    build(key, config) -> (call, ops): a function of no arguments that runs the op `ops` times at that shape with
        that config on fresh operands and returns the outputs (one call amortizes the host's dispatch over `ops`).
    """

    candidates: Callable[[str], Mapping[str, dict[str, Any]]]
    build: Callable[[str, dict[str, Any]], tuple[Callable[[], Any], int]]


TUNABLES: dict[str, Tunable] = {}


def register(op: str, tunable: Tunable) -> None:
    """Make `op`'s `choice` lookups tunable by `pallas_fused.tune`."""
    TUNABLES[op] = tunable
