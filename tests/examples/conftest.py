"""The example script as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def train_llama():
    """examples/train_llama.py, imported by path (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
