"""Which of XLA's passes the wrong gradients of `tests/adapt/_gqa_cotangent.py`'s reproducer hang on (the bug of
`_backend.XLA_GPU_MISCOMPILES`): each pass that changes the reproducer's module disabled in turn, through XLA_FLAGS
in a process of its own, and the value projection's bf16 gradients there (XLA's default options) judged against
float32 autodiff computed here on the CPU, without the flag: a judge compiled under the same flag could share
whatever the flag breaks. A pass whose disabling brings dA and dB under 5% is printed as a fix.

    python benchmarks/probes/xla_pass_bisect.py [--workers 8] [PASS ...]

Without PASS names it takes the passes from a pass-by-pass dump of the reproducer's compile.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))
from tests.adapt._gqa_cotangent import errors, value_gradients_float32  # noqa: E402

CHILD = ("import sys, numpy as np; from tests.adapt._gqa_cotangent import value_gradients; "
         "np.savez(sys.argv[1], *[np.asarray(t, np.float32) for t in value_gradients()])")


def bf16_in_process(xla_flags: str, out: str, timeout: float = 300) -> list[np.ndarray] | str:
    """The reproducer's bf16 (dA, dB) from a process started with `xla_flags`, or why there are none."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()}
    try:
        run = subprocess.run([sys.executable, "-c", CHILD, out], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out"
    if run.returncode:
        return (run.stderr.strip().splitlines() or ["no output"])[-1][:160]
    with np.load(out) as saved:
        return [saved["arr_0"], saved["arr_1"]]


def changing_passes(tmp: str) -> list[str]:
    """The passes that change the reproducer's module, from the file names of XLA's pass-by-pass dump."""
    dump = os.path.join(tmp, "dump")
    bf16_in_process(f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=.*", os.path.join(tmp, "dump.npz"))
    names = {m.group(1) for f in os.listdir(dump) for m in re.finditer(r"\.after_(.+?)\.before_", f)}
    return sorted(names - {"pipeline-start"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("passes", nargs="*")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    want = value_gradients_float32()
    with tempfile.TemporaryDirectory() as tmp:
        def judged(name: str, flags: str) -> None:
            got = bf16_in_process(flags, os.path.join(tmp, f"{name}.npz"))
            result = errors(got, want) if isinstance(got, list) else got
            fixed = isinstance(result, dict) and max(result.values()) < 0.05
            print(f"{'FIX ' if fixed else ''}{name}: {result}", flush=True)

        judged("none disabled", "")
        passes = args.passes or changing_passes(tmp)
        print(len(passes), "passes", flush=True)
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(lambda name: judged(name, f"--xla_disable_hlo_passes={name}"), passes))
