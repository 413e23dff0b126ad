"""What every op's implementation objects share (fp8/gemm.py, dora/impls.py, adam/impls.py).

An op's backends are objects that answer the same four questions, so that the op's api asks them in one place and
the tuner (`pallas_fused.tune`) has something to time:

- `supported(args, device)`: None where it runs these operands on this device, else why not (a sentence);
- `candidates(args, device)`: the configs worth timing, by name (the names the tuning tables keep), default first;
- `default_config(args, device)`: the config it runs without a tuned one;
- `__call__(args, config)`: run it.

`refuses(args)` is the part of `supported` that holds on every device: a forced implementation (named by the
user's `implementation=`, its GPU already checked by `_backend.resolve_implementation`) raises it.
"""

from __future__ import annotations

from typing import Any

from pallas_fused import _backend, _tuning


def current_device() -> _tuning.Device:
    """This process' GPU, or the `_backend.gpu_target` it lowers for, as the implementations see it: its compute
    capability (None without a GPU) and SM count."""
    return _tuning.Device(_backend.device_name(), _backend.compute_capability(), _backend.num_sms())


class Implementation:
    """One backend of an op; `op` names the op in messages."""

    op = "op"
    name: str

    def supported(self, args, device: _tuning.Device) -> str | None:
        return self.refuses(args)

    def refuses(self, args) -> str | None:
        """Why these operands cannot run here at all, whatever the device."""
        return None

    def candidates(self, args, device: _tuning.Device) -> dict[str, Any]:
        return {self.name.rpartition(":")[2]: self.default_config(args, device)}

    def default_config(self, args, device: _tuning.Device) -> Any:
        return None

    def __call__(self, args, config: Any = None):
        raise NotImplementedError

    def __repr__(self):
        return f"<{self.op} implementation {self.name!r}>"
