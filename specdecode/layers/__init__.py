"""The building blocks of the models and drafter heads, each computing through the kernels bound
to it at load time (`bind_kernels`): linear, norm, rotary tables and the LM head's readers."""

from __future__ import annotations

from torch import nn

from specdecode.kernels import Kernels


def bind_kernels(module: nn.Module, kernels: Kernels) -> None:
    """Bind `kernels` to every layer below `module` that computes through them (a `Dense` packs
    its weight into its kernel's layout). Frozen weights: for inference."""
    for m in module.modules():
        bind = getattr(m, "bind_kernels", None)
        if bind is not None:
            bind(kernels)


def quantize_dense(module: nn.Module, fmt: str) -> None:
    """Hold every float `Dense` below `module` in the blocks of `fmt` (before `bind_kernels`)."""
    from specdecode.layers.linear import Dense

    for m in module.modules():
        if isinstance(m, Dense):
            m.quantize(fmt)
