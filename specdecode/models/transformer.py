"""The one decoder-only transformer: Llama (SmolLM2, Mistral-style, Vicuna) and Qwen2 by config.

The forward takes token ids, their positions and an explicit attention mask over the cache slots,
so the new tokens may be a causal chain (prefill, plain decoding) or any tree over the cached
prefix (speculative verification). It returns hidden states; `logits` applies the final norm's
output to the LM head separately, so drafter heads can reuse both the features and the head.

Weights are held fused (q|k|v in one matrix, gate|up in another): fewer, larger matmuls, which is
what a small model on a CPU or a GPU at batch 1 is bound by. They are also stored transposed,
(in, out): for the 2-16 rows of a verification forward, `x @ W_t` runs up to 2x faster on CPU
than `F.linear(x, W)` with the (out, in) layout (measured with MKL on this project's machines).
On CPU in float32 the layers' matrices go one step further, into the tiles of our own few-row
kernel (`cpu_gemm`), where a forward over up to ~12 new tokens costs about what one token does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.attention import AttentionPlan, Segment
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import KVCache
from specdecode.models import cpu_gemm
from specdecode.models.config import ModelConfig


class Dense(nn.Module):
    """y = x @ W (+ bias), with W stored (in, out) as `weight_t`, or, after `tile()`, in the tiles
    of the few-row CPU kernels (cpu_gemm) as `weight_tiles`: (N / 32, in, 32) for float32,
    (N / 32, in / 2, 32, 2) for bfloat16."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features).normal_(0, 0.02))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_parameter("weight_tiles", None)

    def tile(self) -> bool:
        """Re-store the weight in tiles (frozen: for inference); False where the shape does not
        split into tiles or no kernel takes the dtype, which leaves the module as it was."""
        w = self.weight_t.detach()
        if w.shape[1] % cpu_gemm.TILE:
            return False
        if w.dtype == torch.float32 and cpu_gemm.kernel() is not None:
            tiles = cpu_gemm.tile_weight(w)
        elif w.dtype == torch.bfloat16 and cpu_gemm.kernel_bf16() is not None and w.shape[0] % 2 == 0:
            tiles = cpu_gemm.tile_weight_bf16(w)
        else:
            return False
        del self.weight_t  # one copy of the weights, not two
        self.weight_tiles = nn.Parameter(tiles, requires_grad=False)
        return True

    def matrix(self) -> torch.Tensor:
        """The weight as (in, out), whichever way it is stored (a copy when tiled)."""
        if self.weight_tiles is None:
            return self.weight_t
        if self.weight_tiles.dim() == 4:
            return cpu_gemm.untile_weight_bf16(self.weight_tiles)
        return cpu_gemm.untile_weight(self.weight_tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., in) -> (..., out)
        flat = x.reshape(-1, x.shape[-1])
        tiles = self.weight_tiles
        if tiles is None:
            y = flat @ self.weight_t if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
            return y.view(*x.shape[:-1], y.shape[-1])
        if tiles.dim() == 3:
            y = cpu_gemm.tiled_matmul(flat, tiles)
        elif flat.shape[0] <= cpu_gemm.MAX_KERNEL_ROWS_BF16 and flat.is_cpu:
            y = cpu_gemm.tiled_matmul_bf16(flat, tiles).to(flat.dtype)
        else:  # a prefill chunk: oneDNN's bf16 matmul blocks over many rows far better
            y = flat @ cpu_gemm.untile_weight_bf16(tiles)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel instead of six: decoding is op-bound too
            y = cpu_gemm.rms_norm(x, self.weight, self.eps)  # ours on CPU: torch's costs ~40 us
            return y if y is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: normalise in float32, then scale in the weights' dtype, as the
        # reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (D/2,), with Llama-3 style scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise SpecDecodeError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Precomputed cos/sin tables (max_pos, D), indexed by each token's position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_pos, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (B, T) -> cos, sin (B, 1, T, D), broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


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

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        cos: torch.Tensor,  # (B, 1, T, D)
        sin: torch.Tensor,  # (B, 1, T, D)
        plan: AttentionPlan,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        heads = qkv.transpose(1, 2)  # (B, H + 2 H_kv, T, D), a view
        q, k, v = heads.split([self.n_heads, self.n_kv, self.n_kv], dim=1)
        att = plan.attend(self.index, q, k, v, cos, sin)  # (B, H, T, D), rotary applied inside
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GreedyRows(Sequence[int]):
    """Exact greedy tokens of float32 rows on CPU, at about half the LM head's bytes.

    The LM head is the largest matrix of a small model and costs much of a step: a bfloat16 copy
    screens every token of every row in one pass (`Transformer.approx_logits`), and a row's
    tokens whose screened logit could still be the maximum (within a rigorous bound on the
    bfloat16 error) are recomputed in float32 when the row is read. The bound covers rounding the
    weights (max row error norm), the input (its error norm), the output (2^-8 relative, where
    oneDNN rounds it) and float32 accumulation; a row with too many candidates falls back to
    the full float32 product.
    """

    def __init__(self, model: Transformer, hidden: torch.Tensor) -> None:
        _, err_max, norm_max = model._screening_head()
        x = hidden.float()  # (M, C)
        xb = x.bfloat16()
        approx = model.approx_logits(x)  # (M, V)
        top = approx.max(-1).values  # (M,)
        xn, dxn = x.norm(dim=-1), (x - xb.float()).norm(dim=-1)  # (M,)
        bound = xn * err_max + dxn * norm_max + 1e-4 * xn * norm_max + 1e-5
        if model._screen_tiles is None:  # oneDNN rounded the outputs to bfloat16 as well
            bound = bound + approx.abs().max(-1).values / 128
        self._candidates = approx >= (top - 2 * bound).unsqueeze(1)  # (M, V)
        self._x = x
        self._head_t = model.head_weight_t()  # (C, V)
        self._tokens: list[int | None] = [None] * x.shape[0]

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, r: int) -> int:  # type: ignore[override]
        token = self._tokens[r]
        if token is None:
            idx = self._candidates[r].nonzero().squeeze(1)  # (K,) ascending: ties go to the lowest id
            if idx.numel() > 256:
                token = int((self._x[r] @ self._head_t).argmax())
            else:
                token = int(idx[(self._x[r] @ self._head_t[:, idx]).argmax()])
            self._tokens[r] = token
        return token


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A tied head is the embedding itself, read through `head_weight_t` (see there).
        self.lm_head = None if config.tie_word_embeddings else Dense(config.hidden_size, config.vocab_size)
        self.rotary = Rotary(config)
        self._tied_key: tuple[int, int] | None = None
        self._tied_t: torch.Tensor | None = None
        self._screen_key: tuple[int, int] | None = None
        self._screen: tuple[torch.Tensor | None, float, float] | None = None
        self._screen_tiles_key: tuple[int, int] | None = None
        self._screen_tiles: torch.Tensor | None = None  # (V/32, C/2, 32, 2) bfloat16, see cpu_gemm

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        max_len = min(max_len, self.config.max_position_embeddings)
        return KVCache(self.config, max_len, batch_size, self.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        cache: KVCache,
        mask: torch.Tensor | None = None,  # (T, cache.length+T) bool; None = causal chain
    ) -> torch.Tensor:
        """Run new tokens of one sequence over its cached prefix, append their keys/values to the
        cache, and return their final hidden states (B, T, C), after the last norm."""
        return self.forward_plan(
            input_ids, positions, AttentionPlan([Segment.append(cache, input_ids.shape[1], mask)])
        )

    def forward_plan(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """Run a forward described by `plan` (several sequences' segments in one row, for batching);
        every segment's cache advances past its tokens. Returns hidden states (B, T, C)."""
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, plan)
        plan.commit()
        return self.norm(x)

    def head_weight_t(self) -> torch.Tensor:
        """The LM head as (C, V). A tied head is the embedding (V, C) transposed; the transposed
        copy (faster to multiply, see `Dense`) is remade whenever the embedding's storage or
        version changes, so the two can never disagree."""
        if self.lm_head is not None:
            return self.lm_head.weight_t
        key = self._head_key()
        if self._tied_t is None or self._tied_key != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable anywhere
                self._tied_t = self.embed.weight.detach().t().contiguous()
            self._tied_key = key
        return self._tied_t

    def _head_key(self) -> tuple[int, int]:
        """Identity of the LM head's source parameter: its storage and in-place version."""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight_t
        return w.data_ptr(), w._version

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """Exact `logits(hidden).argmax(-1)` for (M, C) hidden states, reading half the bytes
        (see `GreedyRows`)."""
        return list(self.greedy_rows(hidden))

    def greedy_rows(self, hidden: torch.Tensor) -> Sequence[int]:
        """The exact greedy token of each of the (M, C) rows, screened in one pass, each row
        resolved when first read: a verifier walking a draft tree reads only its accepted path."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.dtype != torch.float32 or flat.device.type != "cpu":
            return self.logits(flat).argmax(-1).tolist()
        return GreedyRows(self, flat)

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, C) -> (M, V) float32 logits through the bfloat16 copy of the LM head, on CPU in
        float32 (elsewhere exact `logits`): for drafts and for screening, never for a decision.
        Inputs are rounded to bfloat16 and products summed in float32 by our kernel where the CPU
        has AVX512_BF16 (oneDNN's bf16 path also rounds the outputs to bfloat16, and at one row
        takes as long as the float32 head)."""
        if self.dtype != torch.float32 or hidden.device.type != "cpu":
            return self.logits(hidden)
        tiles = self._bf16_head_tiles()
        if tiles is not None:
            return cpu_gemm.tiled_matmul_bf16(hidden, tiles)
        head = self._screening_head()[0]
        assert head is not None  # kept exactly when there are no tiles
        return F.linear(hidden.bfloat16(), head).float()

    def _bf16_head_tiles(self) -> torch.Tensor | None:
        """The LM head rounded to bfloat16 in the bf16 kernel's tiles (V/32, C/2, 32, 2), remade
        when the head changes; None where that kernel does not run. The rounding is the
        screening head's, so its error figures hold for these tiles too."""
        key = self._head_key()
        if self._screen_tiles_key != key:
            self._screen_tiles = None
            c, v = self.config.hidden_size, self.config.vocab_size
            usable = self.device.type == "cpu" and v % cpu_gemm.TILE == 0 and c % 2 == 0
            if usable and cpu_gemm.kernel_bf16() is not None:
                with torch.inference_mode(False), torch.no_grad():
                    self._screen_tiles = cpu_gemm.tile_weight_bf16(self.head_weight_t().detach())
            self._screen_tiles_key = key
        return self._screen_tiles

    def _screening_head(self) -> tuple[torch.Tensor | None, float, float]:
        """bfloat16 LM head (V, C) with its max row rounding-error norm and max row norm, remade
        when the float32 head changes (same rule as the tied head). The (V, C) copy is kept only
        where the bf16 kernel's tiles (`_bf16_head_tiles`, the same rounding) cannot stand in."""
        key = self._head_key()
        if self._screen_key != key:
            with torch.inference_mode(False), torch.no_grad():
                w = self.head_weight_t().detach().t()  # (V, C)
                head = w.bfloat16().contiguous()
                err_max = float((w - head.float()).norm(dim=-1).max())
                norm_max = float(head.float().norm(dim=-1).max())
            kept = None if self._bf16_head_tiles() is not None else head
            self._screen, self._screen_key = (kept, err_max, norm_max), key
        assert self._screen is not None
        return self._screen

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) hidden states -> (..., V) float32 logits. A bfloat16 model on CPU reads its
        head through the bf16 kernel for a few rows (float32 sums, at memory speed)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.dtype == torch.bfloat16 and flat.is_cpu and flat.shape[0] <= cpu_gemm.MAX_KERNEL_ROWS_BF16:
            tiles = self._bf16_head_tiles()
            if tiles is not None:
                return cpu_gemm.tiled_matmul_bf16(flat, tiles).view(*hidden.shape[:-1], -1)
        return (flat @ self.head_weight_t()).view(*hidden.shape[:-1], -1).float()

    # ---- weights -------------------------------------------------------------------------------

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face Llama/Qwen2 checkpoints: q|k|v and gate|up are
        fused, matrices transposed to (in, out), a tied LM head copied from the embedding."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            try:
                return hf[name]
            except KeyError:
                raise SpecDecodeError(f"checkpoint is missing weight {name!r}") from None

        def fused(names: list[str]) -> torch.Tensor:
            return torch.cat([take(n) for n in names]).t()

        embed = take("model.embed_tokens.weight")
        ours: dict[str, torch.Tensor] = {"embed.weight": embed, "norm.weight": take("model.norm.weight")}
        if not cfg.tie_word_embeddings:  # some untied checkpoints still omit the head
            ours["lm_head.weight_t"] = hf.get("lm_head.weight", embed).t()
        for i in range(cfg.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            ours[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
            ours[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
            ours[f"layers.{i}.qkv.weight_t"] = fused([a + f"{n}_proj.weight" for n in "qkv"])
            if cfg.attention_bias:
                ours[f"layers.{i}.qkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
            ours[f"layers.{i}.o.weight_t"] = take(a + "o_proj.weight").t()
            ours[f"layers.{i}.gate_up.weight_t"] = fused(
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            )
            ours[f"layers.{i}.down.weight_t"] = take(p + "mlp.down_proj.weight").t()
        for name, tensor in ours.items():
            param = self.get_parameter(name)
            if param.shape != tensor.shape:
                raise SpecDecodeError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
        with torch.no_grad():
            for name, tensor in ours.items():
                self.get_parameter(name).copy_(tensor)

    @classmethod
    def from_dir(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> Transformer:
        """Load a Hugging Face model directory (config.json + *.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = ModelConfig.from_dir(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SpecDecodeError(f"{path} has no .safetensors weights")
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(dtype)
        model.rotary = Rotary(config).to(device)
        hf: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                hf.update(load_file(f, device=str(device)))
            except Exception as exc:  # safetensors raises several types for a damaged file
                raise SpecDecodeError(f"cannot read weights {f}: {exc}") from None
        model.load_hf_state_dict(hf)
        model.tile_weights()
        return model.eval()

    def tile_weights(self) -> bool:
        """On CPU, in float32 or bfloat16 where the few-row kernels run, store every layer's
        matrices in their tiles (see cpu_gemm: a verification forward over up to ~12 tokens then
        costs about what a one-token forward does). The LM head stays (in, out): drafters read
        it. Returns whether the weights are tiled."""
        if self.device.type != "cpu":
            return False
        denses = [d for layer in self.layers for d in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return any([d.tile() for d in denses])
