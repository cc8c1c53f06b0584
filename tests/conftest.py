"""Shared fixtures: tiny random HF checkpoints (fast, exact checks) and real models (marked `real`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_hf


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    make_tiny_hf(request.param, out)
    return out


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For modules of tiny-model tests (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny models are all dispatch overhead, and on a busy machine the threads of each op wait on
    one another (measured: up to 100x slower), so they run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
