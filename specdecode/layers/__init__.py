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


def dense_linears(module: nn.Module) -> None:
    """Put a `Dense` holding the same weights in place of every torch `nn.Linear` below `module`,
    so that the kernels run it (Medusa's and ReDrafter's blocks, which train as torch modules and
    keep torch's names in their checkpoints, before `quantize_dense` and `bind_kernels`).

    Why: run as torch's float32 products, a ReDrafter proposal's ten one-row products took ~64
    µs each, half its time (SmolLM2, int8 target, 2-core Zen 4), and read 4x the bytes of Q8_0."""
    from specdecode.layers.linear import Dense

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                weight = child.weight.detach()  # (out, in)
                dense = Dense(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
                if child.bias is not None:
                    dense.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=False)
                setattr(parent, name, dense)
