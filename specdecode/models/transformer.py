"""The one decoder-only transformer: Llama (SmolLM2, Mistral-style, Vicuna) and Qwen2 by config.

The forward takes token ids, their positions and an explicit attention mask over the cache slots,
so the new tokens may be a causal chain (prefill, plain decoding) or any tree over the cached
prefix (speculative verification). It returns hidden states; `logits` applies the final norm's
output to the LM head separately, so drafter heads can reuse both the features and the head.

Weights are held fused (q|k|v in one matrix, gate|up in another): fewer, larger matmuls, which is
what a small model on a CPU or a GPU at batch 1 is bound by. They are also stored transposed,
(in, out). Every layer computes through the kernels bound at load time (`bind_kernels`, chosen by
`specdecode.kernels.select`): on a CPU with our kernels the matrices are re-stored in the tiles of
a few-row kernel, where a forward over up to ~12 new tokens costs about what one token does.

The forward writes the new tokens' keys and values into their slots and leaves the caches'
bookkeeping alone: whoever runs it commits the plan afterwards (`AttentionPlan.commit`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdecode.attention import AttentionPlan, Segment, StaticPlan
from specdecode.errors import SpecDecodeError
from specdecode.kernels import (
    REFERENCE,
    DecoderRows,
    Kernels,
    LayerWeights,
    QuantPart,
    QuantWeight,
    return_freed_memory,
    select,
)
from specdecode.kv_cache import KVCache
from specdecode.layers import bind_kernels
from specdecode.layers.linear import Dense, Embedding, RMSNorm, prefill_rows
from specdecode.layers.lm_head import DraftHead, LMHead
from specdecode.layers.rotary import Rotary
from specdecode.models.config import ModelConfig

EMBEDDING = "model.embed_tokens.weight"  # the input embedding's Hugging Face name


class _Tensors(Mapping[str, torch.Tensor]):
    """The tensors of a directory's safetensors files, each read when asked for (weights held as
    stored elsewhere are never read)."""

    def __init__(self, handles: list[Any], path: Path) -> None:
        self._where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (not a dict)
        self._path = path

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise SpecDecodeError(f"cannot read weight {name} in {self._path}: {exc}") from None

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's would
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP.

    `input_norm` False drops the norm before attention (an identity): EAGLE's draft layer reads
    the output of its fc projection as it is."""

    def __init__(self, config: ModelConfig, index: int, input_norm: bool = True) -> None:
        super().__init__()
        self.index = index
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.attn_norm: nn.Module = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else nn.Identity()
        )
        self.qkv = Dense(config.hidden_size, q_dim + 2 * kv_dim, bias=config.attention_bias)
        self.o = Dense(q_dim, config.hidden_size)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up = Dense(config.hidden_size, 2 * config.intermediate_size)
        self.down = Dense(config.intermediate_size, config.hidden_size)
        self.kernels = REFERENCE

    def bind_kernels(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        cos: torch.Tensor,  # (B, 1, T, D)
        sin: torch.Tensor,  # (B, 1, T, D)
        plan: AttentionPlan | StaticPlan,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        p = plan.prefill_from
        qkv = self.qkv(self.attn_norm(x), p).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        heads = qkv.transpose(1, 2)  # (B, H + 2 H_kv, T, D), a view
        q, k, v = heads.split([self.n_heads, self.n_kv, self.n_kv], dim=1)
        att = plan.attend(self.index, q, k, v, cos, sin, self.kernels)  # (B, H, T, D), rotary inside
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1), p)
        return x + self.down(self.kernels.silu_mul(self.gate_up(self.mlp_norm(x), p)), p)

    def weights(self) -> LayerWeights | None:
        """The layer as `DecoderRows` takes it, where every matrix is held by the quantized
        kernel and its norms are float32 RMS norms (or it has none before attention; None
        otherwise)."""
        denses = (self.qkv, self.o, self.gate_up, self.down)
        quant = self.kernels.quant
        if quant is None or any(d.quantized is None or d.kernel is not quant for d in denses):
            return None
        attn_norm = None  # no norm before attention (EAGLE's layer)
        if isinstance(self.attn_norm, RMSNorm):
            if self.attn_norm.eps != self.mlp_norm.eps or self.attn_norm.weight.dtype != torch.float32:
                return None
            attn_norm = self.attn_norm.weight.detach()
        if self.mlp_norm.weight.dtype != torch.float32:
            return None
        qkv, o, gate_up, down = (d.quantized for d in denses)
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        return LayerWeights(
            attn_norm, self.mlp_norm.weight.detach(), self.mlp_norm.eps,
            qkv, _bias(self.qkv), o, _bias(self.o), gate_up, _bias(self.gate_up), down, _bias(self.down),
            self.n_heads, self.n_kv, self.head_dim,
        )  # fmt: skip


class OneCallLayers:
    """Layers run by their kernels' one-call decoder (`Kernels.decoder`) where it takes them all:
    the same bits as calling them one by one, without the Python between them. Laid out by
    `bind`, and again when first run with other kernels (a module that binds its layers through
    `layers.bind_kernels`, as EAGLE's head does, never calls `bind` itself)."""

    def __init__(self, layers: Sequence[Block]) -> None:
        self.layers = list(layers)
        self.kernels: Kernels | None = None
        self.decoder: tuple[DecoderRows, object] | None = None  # None: the layers one by one

    def bind(self, kernels: Kernels) -> None:
        """Lay the layers out for `kernels`' decoder, where it takes every one of them."""
        self.kernels, self.decoder = kernels, None
        weights = [layer.weights() for layer in self.layers]
        if kernels.decoder is not None and weights and all(w is not None for w in weights):
            prepared = kernels.decoder.prepare(weights)  # type: ignore[arg-type]
            if prepared is not None:
                self.decoder = kernels.decoder, prepared

    def __call__(
        self,
        x: torch.Tensor,  # (1, T, C) the first layer's input, a scratch tensor: overwritten
        cos: torch.Tensor,  # (1, 1, T, D)
        sin: torch.Tensor,  # (1, 1, T, D)
        plan: AttentionPlan | StaticPlan,
    ) -> torch.Tensor | None:
        """The layers' output (1, T, C) from one kernel call, where every row goes through the
        row attention; else None (call the layers)."""
        kernels = self.layers[0].kernels
        if kernels is not self.kernels:
            self.bind(kernels)
        if self.decoder is None or torch.is_grad_enabled() or x.shape[0] != 1:
            return None
        rows = plan.kernel_rows(kernels, cos.shape[-1], x.dtype, x.device)
        if rows is None:
            return None
        flat = x[0].contiguous()  # (T, C): overwritten (x too, where it is contiguous)
        caches = [rows.cache.layer_slots(i) for i in range(len(self.layers))]
        run, prepared = self.decoder
        run.run(
            prepared, flat, caches, rows.rows, rows.new_slots, rows.row_ptr, rows.idx, cos[0, 0],
            sin[0, 0], prefill_rows(flat.shape[0], plan.prefill_from),
        )  # fmt: skip
        return flat[None]


def _bias(dense: Dense) -> torch.Tensor | None:
    return None if dense.bias is None else dense.bias.detach()


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A tied head is the embedding itself, read through `head_weight_t` (see there).
        self.lm_head = None if config.tie_word_embeddings else Dense(config.hidden_size, config.vocab_size)
        self.rotary = Rotary(config)
        self.head = LMHead(self.embed, self.lm_head)  # reads the LM head (not a module of its own)
        self.kernels = REFERENCE
        # Every layer in one kernel call, where the layers allow: laid out by `bind_kernels`,
        # used by `forward_plan` when every row goes through the row attention.
        self.one_call = OneCallLayers(self.layers)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def runs_stored(self) -> bool:
        """Whether its layers' products run on weights held in block formats (a GGUF as stored,
        or quantized on load): drafter heads beside it are then held in DRAFT_FORMAT too."""
        return any(isinstance(m, Dense) and m.kernel is self.kernels.quant for m in self.layers.modules())

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        max_len = min(max_len, self.config.max_position_embeddings)
        return KVCache(self.config, max_len, batch_size, self.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        cache: KVCache,
        mask: torch.Tensor | None = None,  # (T, cache.length+T) bool; None = causal chain
        prompt: bool | None = None,
    ) -> torch.Tensor:
        """Run new tokens of one sequence over its cached prefix, append their keys/values to the
        cache (committed: the cache's length moves past them), and return their final hidden
        states (B, T, C), after the last norm. `prompt`: whether the tokens are a prompt's, which
        the quantized kernels may compute another way (`prefill_rows`; None: more than 64 are)."""
        prefill_from = None if prompt is None else (0 if prompt else input_ids.shape[1])
        plan = AttentionPlan([Segment.append(cache, input_ids.shape[1], mask)], prefill_from)
        hidden = self.forward_plan(input_ids, positions, plan)
        plan.commit()
        return hidden

    def forward_plan(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        plan: AttentionPlan | StaticPlan,
    ) -> torch.Tensor:
        """Run a forward described by `plan` (several sequences' segments in one row, for batching):
        every segment's keys/values are written to its slots, and no cache's length moves (the
        caller commits the plan). Returns hidden states (B, T, C)."""
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed(input_ids)
        one_call = self.one_call(x, cos, sin, plan)
        if one_call is not None:
            return self.norm(one_call)
        for layer in self.layers:
            x = layer(x, cos, sin, plan)
        return self.norm(x)

    # ---- the LM head (see `layers.lm_head`) ------------------------------------------------------

    def head_weight_t(self) -> torch.Tensor:
        """The LM head as (C, V) (a tied head's transposed copy, remade when the embedding changes)."""
        return self.head.weight_t()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) hidden states -> (..., V) float32 logits."""
        return self.head.logits(hidden)

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, C) -> (M, V) float32 logits, approximate (bfloat16 products) for a float32 model
        where the kernels offer it: for drafts and screening, never for a decision."""
        return self.head.approx_logits(hidden)

    def approx_head(self, columns: torch.Tensor | None = None) -> DraftHead:
        """A head over the vocabulary `columns` (V',) (all where None) for a drafter to keep and
        call: float32 logits, approximate where the kernels offer that (see `layers.lm_head`)."""
        return self.head.subset(columns)

    def greedy_rows(self, hidden: torch.Tensor) -> Sequence[int]:
        """The exact greedy token of each of the (M, C) rows, each resolved when first read."""
        return self.head.greedy_rows(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """Exact `logits(hidden).argmax(-1)` for (M, C) hidden states."""
        return list(self.greedy_rows(hidden))

    # ---- weights -------------------------------------------------------------------------------

    def load_hf_state_dict(self, hf: Mapping[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face Llama/Qwen2 checkpoints: q|k|v and gate|up are
        fused, matrices transposed to (in, out), a tied LM head copied from the embedding.
        Layers already holding a weight as stored (`load_stored`) are left alone."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            try:
                return hf[name]
            except KeyError:
                raise SpecDecodeError(f"checkpoint is missing weight {name!r}") from None

        def fused(names: list[str], transpose: bool = True) -> Callable[[], torch.Tensor]:
            return lambda: (lambda w: w.t() if transpose else w)(torch.cat([take(n) for n in names]))

        def one(name: str, transpose: bool = False) -> Callable[[], torch.Tensor]:
            return lambda: take(name).t() if transpose else take(name)

        ours: dict[str, Callable[[], torch.Tensor]] = {
            "embed.weight": one(EMBEDDING),
            "norm.weight": one("model.norm.weight"),
        }
        if not cfg.tie_word_embeddings:  # some untied checkpoints still omit the head
            ours["lm_head.weight_t"] = lambda: hf.get("lm_head.weight", take(EMBEDDING)).t()
        for i in range(cfg.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            ours[f"layers.{i}.attn_norm.weight"] = one(p + "input_layernorm.weight")
            ours[f"layers.{i}.mlp_norm.weight"] = one(p + "post_attention_layernorm.weight")
            ours[f"layers.{i}.qkv.weight_t"] = fused([a + f"{n}_proj.weight" for n in "qkv"])
            if cfg.attention_bias:
                ours[f"layers.{i}.qkv.bias"] = lambda a=a: torch.cat(
                    [take(a + f"{n}_proj.bias") for n in "qkv"]
                )
            ours[f"layers.{i}.o.weight_t"] = one(a + "o_proj.weight", transpose=True)
            ours[f"layers.{i}.gate_up.weight_t"] = fused(
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            )
            ours[f"layers.{i}.down.weight_t"] = one(p + "mlp.down_proj.weight", transpose=True)
        params = dict(self.named_parameters())
        loaded = {name: make() for name, make in ours.items() if name in params}  # stored ones are not
        for name, tensor in loaded.items():
            if params[name].shape != tensor.shape:
                raise SpecDecodeError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in loaded.items():
                params[name].copy_(tensor)

    def load_stored(self, stored: Mapping[str, tuple[str, Any]], embedding: bool = True) -> None:
        """Hold the linear weights, the LM head and (with `embedding`) the input embedding of a
        GGUF as stored, in their block formats: `stored` maps Hugging Face names to (format,
        (rows, row_bytes) uint8 blocks), as `gguf.stored_weights` reads them. A layer whose parts
        are not all there stays float."""

        def hold(dense: Dense, names: list[str]) -> bool:
            if all(n in stored for n in names):
                with warnings.catch_warnings():  # read-only views of the file: only ever read
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    parts = tuple(QuantPart(stored[n][0], torch.from_numpy(stored[n][1])) for n in names)
                dense.load_quantized(QuantWeight(dense.weight_t.shape[0], parts))
                return True
            return False

        for dense, names in self._linear_parts():
            hold(dense, names)
        c, vocab = self.config.hidden_size, self.config.vocab_size
        head = self._head_name()
        if head in stored:  # the head reads the stored matrix
            if self.lm_head is None:  # tied: the stored embedding, read as the head
                self.lm_head = Dense(c, vocab).to(self.device)
                self.head = LMHead(self.embed, self.lm_head)
            hold(self.lm_head, [head])
        name = EMBEDDING
        if embedding and name in stored:
            tied = self.lm_head if self.config.tie_word_embeddings else None
            if tied is not None and tied.quantized is not None:
                self.embed.load_stored(tied)
            else:
                table = Dense(c, vocab).to(self.device)
                if hold(table, [name]):
                    self.embed.load_stored(table)

    def _linear_parts(self) -> list[tuple[Dense, list[str]]]:
        """Each layer's linear weights with the Hugging Face names of their parts."""
        out = []
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            out += [
                (layer.qkv, [a + f"{n}_proj.weight" for n in "qkv"]),
                (layer.o, [a + "o_proj.weight"]),
                (layer.gate_up, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                (layer.down, [p + "mlp.down_proj.weight"]),
            ]
        return out

    def _head_name(self) -> str:
        return EMBEDDING if self.config.tie_word_embeddings else "lm_head.weight"

    def stored_names(self) -> list[str]:
        """The Hugging Face names of the weights `load_stored` can hold as stored."""
        return [n for _, names in self._linear_parts() for n in names] + [self._head_name()]

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        stored: Path | None = None,
        quantization: str | None = None,
    ) -> Transformer:
        """Load a Hugging Face model directory (config.json + *.safetensors). With `stored`, the
        GGUF file the directory was converted from, its quantized weights stay as stored (run in
        float32 through the kernels' quantized products, or dequantized where there are none).
        With `quantization` (see `gguf.QUANTIZATIONS`), the float linear weights and LM head are
        quantized on load and then held the same way (with `stored` too, a GGUF's dequantized
        weights quantized again, its input embedding kept as stored: a draft model's choice)."""
        from safetensors import safe_open

        from specdecode.models.gguf import quantized_weights, stored_weights

        path = Path(path)
        config = ModelConfig.from_dir(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SpecDecodeError(f"{path} has no .safetensors weights")
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(dtype)
        model.rotary = Rotary(config).to(device)
        try:
            handles = [safe_open(str(f), framework="pt", device=str(device)) for f in files]
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise SpecDecodeError(f"cannot read weights in {path}: {exc}") from None
        tensors = _Tensors(handles, path)
        if quantization is not None:
            weights = quantized_weights(tensors, model.stored_names(), quantization)
            if stored is not None:  # a GGUF quantized again: its input embedding stays as stored
                weights |= {n: w for n, w in stored_weights(stored).items() if n == EMBEDDING}
            # A float checkpoint's input embedding stays float (its own values).
            model.load_stored(weights, embedding=stored is not None)
        elif stored is not None:
            model.load_stored(stored_weights(stored))
        model.load_hf_state_dict(tensors)
        model.bind_kernels()
        return model.eval()

    def bind_kernels(self, kernels: Kernels | None = None) -> None:
        """Compute through `kernels` from now on (default: `specdecode.kernels.select` for the
        model's device): each layer's matrix is re-stored, frozen, in its kernel's layout. The
        LM head stays (in, out): drafters and training read it."""
        self.kernels = kernels or select(self.device)
        for layer in self.layers:
            bind_kernels(layer, self.kernels)
        self.one_call.bind(self.kernels)
        self.norm.bind_kernels(self.kernels)
        if self.lm_head is not None:
            self.lm_head.bind_kernels(self.kernels, pack=False)
        self.embed.bind_kernels(self.kernels)
        self.head.bind_kernels(self.kernels)
        return_freed_memory()  # the copies the re-stored weights were made through
