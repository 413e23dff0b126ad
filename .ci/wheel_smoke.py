"""Run from outside the source tree, in a venv holding only the built wheel and its dependencies:
the package imports from site-packages, ships py.typed, reports its version, pulls in no test- or example-only
dependency, and runs one op on the CPU against its reference. Given a Markdown file (the README), it then runs
its ```python blocks in order in one namespace, as tests/test_docs.py does from the source tree, from a scratch
directory: what the README shows runs from the installed wheel.

    python .ci/wheel_smoke.py [README.md]
"""

import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fused
from pallas_fused.rotary import apply_rotary, reference_rotary

assert "site-packages" in pallas_fused.__file__, pallas_fused.__file__
assert pallas_fused.__version__ == importlib.metadata.version("pallas-fused"), pallas_fused.__version__
assert importlib.resources.files("pallas_fused").joinpath("py.typed").is_file(), "py.typed is not in the wheel"
for extra_only in ("matplotlib", "pytest", "tqdm"):  # (orbax comes with flax)
    assert importlib.util.find_spec(extra_only) is None, f"{extra_only} was installed as a runtime dependency"

q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8), jnp.float32)
k = jax.random.normal(jax.random.key(1), (2, 5, 2, 8), jnp.float32)
got = apply_rotary(q, k, implementation="interpret")
want = reference_rotary(q, k, jnp.arange(5), rotary_dim=8)
np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
print(f"pallas_fused {pallas_fused.__version__} from the wheel: import and apply_rotary (interpret) ok")

if len(sys.argv) > 1:
    # The block and skip-mark rules of tests/test_docs.py (pytest is not installed here, so it is not imported).
    fence = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
    readme = Path(sys.argv[1]).resolve()
    text = readme.read_text()
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    os.chdir(tempfile.mkdtemp())  # a block that writes files writes them here
    for match in fence.finditer(text):
        before = text[: match.start()].rstrip()
        if match.group(1) != "python" or re.search(r"<!--\s*skip(:[^>]*)?-->$", before):
            continue
        line = text.count("\n", 0, match.start()) + 1
        exec(compile(match.group(2), f"{readme.name}:{line}", "exec"), namespace)
        ran += 1
    assert ran, f"no python block in {readme}"
    assert "site-packages" in sys.modules["pallas_fused"].__file__
    print(f"{readme.name}: {ran} python blocks ran from the installed wheel")
