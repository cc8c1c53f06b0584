"""Shared fixtures: tiny random HF checkpoints (fast, exact checks) and real models (marked `real`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdecode.models.transformer import Transformer
from tests.tiny import make_tiny_hf, write_chat_tokenizer


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    make_tiny_hf(request.param, out)
    return out


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> Transformer:
    """The tiny target of `tiny_model_dir`, loaded once per module (and per architecture)."""
    return Transformer.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint with a character-level ChatML tokenizer: what the training
    pipeline and `LLM` need (a chat template, text in and out)."""
    out = tmp_path_factory.mktemp("tiny_chat")
    make_tiny_hf("llama", out, seed=0)
    write_chat_tokenizer(out)
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
