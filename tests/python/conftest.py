"""Fixtures shared by the Python reference tests."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gen_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Every tiny preset of scripts/gen_tiny_model.py, written once per test session."""
    d = tmp_path_factory.mktemp("tiny_models")
    gen_tiny_model.write_all(d)
    return d
