"""Reading the LM head: exact logits, approximate ones for drafts, and exact greedy tokens screened
through the approximate copy.

The LM head is the largest matrix of a small model and costs much of a step. Where the kernels
offer an approximate (bfloat16) product, a packed bfloat16 copy screens every token of every row
in one pass, and a row's tokens whose screened logit could still be the maximum (within a
rigorous bound on the bfloat16 error) are recomputed in float32 when the row is read: exact
greedy tokens at about half the bytes. A tied head is the embedding, read transposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.kernels import REFERENCE, TORCH_LINEAR, Kernels, LinearKernel, QuantWeight, quantize
from specdecode.layers.linear import Dense, Embedding
from specdecode.sampling import argmax_rows

# The block format drafters' copies of a stored head (and their own layers, beside a target that
# runs as stored) are held in: a byte a weight, read once per draft depth.
DRAFT_FORMAT = "Q8_0"


class ApproxHead:
    """float32 logits over some of the head's columns for drafts and screening, never for a
    decision: through an approximate kernel (inputs and weights rounded to bfloat16), or, where
    `exact`, the head's own product in its dtype."""

    def __init__(self, kernel: LinearKernel, weight_t: Tensor, exact: bool = False) -> None:  # (C, V')
        self.kernel = kernel
        self._cast = weight_t.dtype if exact else None
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable anywhere
            self.packed = kernel.pack(weight_t.detach().contiguous() if exact else weight_t.detach())

    def __call__(self, hidden: Tensor) -> Tensor:
        # hidden (M, C) -> (M, V') float32
        x = hidden if self._cast is None else hidden.to(self._cast)
        return self.kernel.matmul(x, self.packed).float()


class QuantizedHead:
    """Columns of a head that runs as stored, a Dense (C -> V') held in block formats and
    multiplied by the quantized kernel (float32 inputs and sums)."""

    def __init__(self, dense: Dense) -> None:
        self.dense = dense

    @classmethod
    def of_columns(cls, weight_t: Tensor, fmt: str, kernels: Kernels) -> QuantizedHead:
        """(C, V') float columns held in the blocks of `fmt` (C is whole blocks: the stored
        head's own rows are): drafts read a byte a weight."""
        return cls.of_weight(quantize(weight_t, fmt), kernels)

    @classmethod
    def of_weight(cls, weight: QuantWeight, kernels: Kernels) -> QuantizedHead:
        with torch.inference_mode(False), torch.no_grad():
            with torch.device("meta"):  # its float parameter is dropped for the blocks
                dense = Dense(weight.in_features, weight.out_features)
            dense.load_quantized(weight)
            dense.bind_kernels(kernels)
        return cls(dense)

    def __call__(self, hidden: Tensor) -> Tensor:
        # hidden (M, C) -> (M, V') float32
        return self.dense(hidden.float())


# What a drafter keeps to read its logits from: (M, C) -> (M, V') float32.
DraftHead = ApproxHead | QuantizedHead


class LMHead:
    """The model's LM head, read four ways (see the module doc). Copies made from the head (the
    tied transpose, the approximate copy, its error figures) are remade whenever the head's
    parameter changes storage or version, so they can never disagree with it."""

    def __init__(self, embed: Embedding, dense: Dense | None) -> None:
        self._embed, self._dense = embed, dense  # a tied head when `dense` is None
        self.kernels = REFERENCE
        self._tied: tuple[tuple[int, int], Tensor] | None = None
        self._approx: tuple[tuple[int, int], ApproxHead, float, float] | None = None

    def bind_kernels(self, kernels: Kernels) -> None:
        self.kernels, self._approx = kernels, None

    @property
    def stored(self) -> bool:
        """Whether the head is held in a GGUF's block formats (its product is then the fast one)."""
        return self._dense is not None and self._dense.quantized is not None

    def key(self) -> tuple[int, int]:
        """Identity of the head's source parameter: its storage and in-place version."""
        if self._dense is not None and self._dense.quantized is not None:
            return self._dense.quantized.parts[0].data.data_ptr(), 0
        w = self._embed.matrix() if self._dense is None else self._dense.weight_t
        return w.data_ptr(), w._version

    def weight_t(self) -> Tensor:
        """The LM head as (C, V): the transposed copy of a tied embedding is faster to multiply;
        a stored head's dequantized copy (for drafters and training)."""
        if self._dense is not None and self._dense.quantized is None:
            return self._dense.weight_t
        key = self.key()
        if self._tied is None or self._tied[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                source = self._embed.matrix().detach().t() if self._dense is None else self._dense.matrix()
                self._tied = key, source.contiguous()
        return self._tied[1]

    @property
    def approximates(self) -> bool:
        """Whether an approximate product exists here (else `approx_logits` is exact)."""
        return bool(self.kernels.approx) and not self.stored

    def subset(self, columns: Tensor | None) -> DraftHead:
        """A head over the vocabulary `columns` (V',) long (all where None) for a drafter to keep:
        for a head that runs as stored, its first V' columns as they are stored (where `columns`
        is 0 .. V'-1 and the layout can cut there), else its columns in DRAFT_FORMAT blocks (read
        without a float copy of the whole head; all of them: the head itself); approximate for a
        float32 head where the kernels offer that; else exact."""
        quant = self.kernels.quant
        if self.stored and quant is not None and DRAFT_FORMAT in quant.formats:
            assert self._dense is not None and self._dense.quantized is not None
            if columns is None:  # the whole head: its own stored product, no second copy
                return QuantizedHead(self._dense)
            n = columns.numel()
            if n and bool((columns.cpu() == torch.arange(n)).all()):
                first = quant.first_outputs(self._dense.quantized, n)
                if first is not None:  # a view of the head's own blocks, no copy
                    return QuantizedHead.of_weight(first, self.kernels)
            return QuantizedHead.of_columns(self._dense.columns(columns.cpu()), DRAFT_FORMAT, self.kernels)
        if columns is None and self.approximates and self.weight_t().dtype == torch.float32:
            return self._approx_head()[0]  # the screening copy: one approximate copy of the head
        return self._float_columns(columns)

    def _float_columns(self, columns: Tensor | None) -> ApproxHead:
        """A float head's `columns` (all where None), approximate where `subset` says."""
        head_t = self.weight_t().detach()
        if columns is not None:
            head_t = head_t[:, columns.to(head_t.device)]
        if head_t.dtype == torch.float32 and self.kernels.approx:
            return ApproxHead(self.kernels.approx_for(head_t), head_t)
        return ApproxHead(TORCH_LINEAR, head_t, exact=True)

    def _approx_head(self) -> tuple[ApproxHead, float, float]:
        """The whole head's approximate copy, its max column rounding-error norm and max column
        norm (what bounds the screen's error)."""
        key = self.key()
        if self._approx is None or self._approx[0] != key:
            head = self._float_columns(None)
            with torch.inference_mode(False), torch.no_grad():
                w = self.weight_t().detach().float()  # (C, V)
                rounded = w.bfloat16().float()
                err_max = float((w - rounded).norm(dim=0).max())
                norm_max = float(rounded.norm(dim=0).max())
            self._approx = key, head, err_max, norm_max
        return self._approx[1:]

    def logits(self, hidden: Tensor) -> Tensor:
        """(..., C) hidden states -> (..., V) float32 logits. A bfloat16 head goes through the
        approximate kernel when that keeps float32 sums (exact for bfloat16 inputs and weights)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self._dense is not None and self._dense.quantized is not None:
            return self._dense(flat).float().view(*hidden.shape[:-1], -1)
        w = self.weight_t()
        if w.dtype == torch.bfloat16 and self.approximates:
            head = self._approx_head()[0]
            if not head.kernel.rounds_output:
                return head(flat).view(*hidden.shape[:-1], -1)
        product = self.kernels.head
        logits = flat @ w if product is None else product.matmul(flat, w)
        return logits.view(*hidden.shape[:-1], -1).float()

    def approx_logits(self, hidden: Tensor) -> Tensor:
        """(M, C) -> (M, V) float32 logits through the approximate copy of a float32 head (else
        exact `logits`)."""
        if not self.approximates or self.weight_t().dtype != torch.float32:
            return self.logits(hidden)
        return self._approx_head()[0](hidden)

    def greedy_rows(self, hidden: Tensor) -> Sequence[int]:
        """The exact greedy token of each of the (M, C) rows, screened in one pass, each row
        resolved when first read: a verifier walking a draft tree reads only its accepted path."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if not self.approximates or self.weight_t().dtype != torch.float32:
            return argmax_rows(self.logits(flat))
        return GreedyRows(self, flat)


class GreedyRows(Sequence[int]):
    """Exact greedy tokens of float32 rows, screened through the approximate head.

    The bound covers rounding the weights (max column error norm), the input (its error norm),
    the output (2^-8 relative, where the kernel rounds it) and float32 accumulation; a row with
    too many candidates falls back to the full float32 product.
    """

    def __init__(self, head: LMHead, hidden: Tensor) -> None:
        approx_head, err_max, norm_max = head._approx_head()
        x = hidden.float()  # (M, C)
        approx = approx_head(x)  # (M, V)
        top = approx.max(-1).values  # (M,)
        xn, dxn = x.norm(dim=-1), (x - x.bfloat16().float()).norm(dim=-1)  # (M,)
        bound = xn * err_max + dxn * norm_max + 1e-4 * xn * norm_max + 1e-5
        if approx_head.kernel.rounds_output:
            bound = bound + approx.abs().max(-1).values / 128
        self._candidates = approx >= (top - 2 * bound).unsqueeze(1)  # (M, V)
        self._x = x
        self._head_t = head.weight_t()  # (C, V)
        self._tokens: list[int | None] = [None] * x.shape[0]

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, r: int) -> int:  # type: ignore[override]
        token = self._tokens[r]
        if token is None:
            idx = self._candidates[r].nonzero().squeeze(1)  # (K,) ascending: ties go to the lowest id
            if idx.numel() > 256:
                token = argmax_rows((self._x[r] @ self._head_t)[None])[0]
            else:
                token = int(idx[argmax_rows((self._x[r] @ self._head_t[:, idx])[None])[0]])
            self._tokens[r] = token
        return token
