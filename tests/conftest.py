"""Shared fixtures: tiny random HF checkpoints (fast, exact checks) and real models (marked `real`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import make_tiny_hf


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    make_tiny_hf(request.param, out)
    return out
