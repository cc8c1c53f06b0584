"""Medusa: K small heads on the target's last hidden state guess the next K tokens at once.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". Head k (k = 0..K-1) maps the target's final hidden state h_t at position t, the row whose
LM-head output is the token at t+1, to a distribution over the token at t+2+k.

With specdecode's bookkeeping (the root is the last decided token, not yet run by the target),
h_t is the row that *produced* the root: after a step, the row of the last accepted node, or of
the root when nothing was accepted, whose target output is the step's bonus or recovered token,
i.e. the next root. So head k guesses the token k+1 places after the root: depth k+1 of the
draft tree. Worked example, prompt "A B C" (root C, cache [A B]): `begin` keeps h(B), whose
LM-head output was C; head 0 guesses the token after C, head 1 the one after that.

The tree is declared once as `medusa_choices` (paths of top-k ranks, `tree.from_choices`): a
node at depth d with rank r holds head d-1's r-th most likely token, the same candidates under
every parent, since the heads see only h_t. Tokens are deterministic top-k picks, so the lossless
verifier treats them as point masses (draft_probs None): greedy output equals plain greedy
decoding and sampling reproduces the target distribution. Medusa's typical acceptance
(`verify.verify_typical`) trades that exactness for longer accepts, only when asked for.

Checkpoints are directories, in one of two layouts:

- specdecode's: `medusa.safetensors` + `config.json` (`method`, `num_heads`, `num_layers`,
  `hidden_size`, `vocab_size`, `shared_lm_head`, `target`, optionally the `medusa_choices` fitted
  at training time). Heads that share the target's LM head store no LM-head weights; they may
  store a draft vocabulary (`draft_vocab`, `draft_vocab_size` in the config), as EAGLE and
  ReDrafter heads do: the ids they draft from. The heads' K rows then go through the target's LM
  head over those columns alone; over SmolLM2's whole 49k vocabulary that product was most of a
  draft's cost (3 rows ~1.1 ms against ~0.15 ms over 16k ids, int8 activations, 2 threads, Zen 4),
  and its top-k over fewer logits costs less too.
- the Medusa reference implementation's: `medusa_lm_head.safetensors` (or `.pt`) holding
  `{i}.{j}.linear.weight|bias` for head i's residual block j and `{i}.{num_layers}.weight` for its
  own LM head, next to a `config.json` with `medusa_num_heads` / `medusa_num_layers`.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.drafters import checkpoint
from specdecode.drafters.base import LastRowDrafter, Proposal, opening_proposal
from specdecode.drafters.checkpoint import CONFIG
from specdecode.errors import SpecDecodeError
from specdecode.layers.lm_head import DraftHead
from specdecode.models.transformer import Transformer
from specdecode.tree import DraftTree, from_choices
from specdecode.verify import verify_typical

if TYPE_CHECKING:
    from specdecode.request import Request

WEIGHTS = "medusa.safetensors"
REFERENCE_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
LAYOUTS = checkpoint.Layouts(
    "Medusa heads", "medusa", "a Medusa", WEIGHTS, REFERENCE_WEIGHTS, " (Medusa reference)"
)
# Nodes of the tree used when none is given: one forward over 9 tokens costs ~1.4x one token for
# SmolLM2 on a CPU, over 33 ~2.5x (Spec-Bench, session 3: 8 nodes 0.94x plain at tau 1.33, the
# fitted 32-node tree 0.57x at tau 1.63).
DEFAULT_TREE_NODES = 8


class ResBlock(nn.Module):
    """x + SiLU(W x + b). Built as the identity (W = 0, b = 0), so an untrained head is exactly
    the LM head: training starts from "predict the next token" and learns the shift."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of `num_layers` residual blocks each, then an LM head.

    `shared_lm_head`: every head uses the target's LM head (passed to `forward`), so a checkpoint
    holds only the blocks (K * C * (C+1) numbers, a few MB for SmolLM2) instead of K copies of a
    V x C matrix. `choices` is the tree fitted to these heads when they were trained, if any.
    `draft_vocab` (V',) long: the ids the heads draft from (None: all; only with the shared head).
    """

    WEIGHTS: ClassVar[str] = WEIGHTS  # its weights file (`checkpoint.save_head`)

    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        shared_lm_head: bool = True,
        choices: Sequence[Sequence[int]] | None = None,
        draft_vocab: Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise SpecDecodeError(f"Medusa needs >= 1 head and >= 0 layers, got {num_heads}, {num_layers}")
        if draft_vocab is not None and not shared_lm_head:
            raise SpecDecodeError("a Medusa draft vocabulary needs the shared LM head")
        self.draft_vocab = None if draft_vocab is None else torch.unique(draft_vocab.long())  # (V',) sorted
        self._draft_head = checkpoint.DraftColumns()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.shared_lm_head = shared_lm_head
        self.choices = None if choices is None else [list(c) for c in choices]
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.lm_heads = (
            None
            if shared_lm_head
            else nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        )

    def draft_head(self, target: Transformer) -> DraftHead:
        """The target's LM head over the draft vocabulary (all of it without one), as the target's
        kernels read it for drafts (`checkpoint.DraftColumns`)."""
        return self._draft_head(target, self.draft_vocab)

    def features(self, hidden: Tensor, num_heads: int | None = None) -> Tensor:
        """(..., C) target hidden states -> (K', ..., C) each head's input to its LM head."""
        k = self.num_heads if num_heads is None else num_heads
        return torch.stack([self.blocks[i](hidden) for i in range(k)])

    def forward(
        self, hidden: Tensor, shared_weight_t: Tensor | None = None, num_heads: int | None = None
    ) -> Tensor:
        """(..., C) target hidden states -> (K', ..., V) logits of the first K' heads.

        `shared_weight_t` (C, V) is the target's LM head (`Transformer.head_weight_t()`),
        required when the heads share it; the features are cast to its dtype and the logits
        come in it, so a bfloat16 copy keeps the big matmul and what follows in bfloat16.
        """
        feats = self.features(hidden, num_heads)  # (K', ..., C)
        if self.lm_heads is None:
            if shared_weight_t is None:
                raise ValueError("these heads share the target's LM head: pass its weight_t")
            return feats.to(shared_weight_t.dtype) @ shared_weight_t
        return torch.stack([self.lm_heads[i](f) for i, f in enumerate(feats)])

    def saved(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        fitted = {} if self.choices is None else {"medusa_choices": self.choices}
        vocab = {} if self.draft_vocab is None else {checkpoint.DRAFT_VOCAB: self.draft_vocab.to("cpu")}
        return {**self.config(), **fitted}, vocab

    def config(self) -> dict[str, Any]:
        return {
            "method": "medusa",
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "shared_lm_head": self.shared_lm_head,
            "draft_vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
        }


# ------------------------------------------------------------------------------------------------
# Checkpoints


save_heads = checkpoint.save_head  # (heads, out, target, dtype=float16, extra=None) -> out


def _load_ours(path: Path, config: dict[str, Any]) -> MedusaHeads:
    tensors = checkpoint.read_tensors(path / WEIGHTS, "Medusa")
    try:
        vocab_size = int(config["vocab_size"])
        heads = MedusaHeads(
            int(config["num_heads"]),
            int(config["num_layers"]),
            int(config["hidden_size"]),
            vocab_size,
            bool(config.get("shared_lm_head", True)),
            config.get("medusa_choices"),
            checkpoint.draft_vocab(tensors, vocab_size, path / WEIGHTS),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecDecodeError(f"{path / CONFIG} is not a specdecode Medusa config ({exc!r})") from None
    size = None if heads.draft_vocab is None else heads.draft_vocab.numel()
    if config.get("draft_vocab_size") != size:
        raise SpecDecodeError(
            f"{path / WEIGHTS}: its draft vocabulary does not match draft_vocab_size in {CONFIG}"
        )
    checkpoint.load_state(heads, tensors, path / WEIGHTS, "Medusa")
    return heads


def _load_reference(file: Path, config: dict[str, Any]) -> MedusaHeads:
    """The Medusa reference layout: head i is `nn.Sequential(ResBlock * L, Linear(C, V))`, so its
    blocks are `{i}.{j}.linear.*` and its LM head `{i}.{L}.weight`."""
    state = checkpoint.read_tensors(file, "Medusa")
    try:
        num_heads = int(config.get("medusa_num_heads") or 1 + max(int(k.split(".")[0]) for k in state))
        num_layers = int(config.get("medusa_num_layers", 1))
        vocab_size, hidden_size = state[f"0.{num_layers}.weight"].shape
    except (KeyError, ValueError) as exc:
        raise SpecDecodeError(f"{file} is not a Medusa reference checkpoint ({exc!r})") from None
    heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size, shared_lm_head=False)
    renamed: dict[str, Tensor] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            for kind in ("weight", "bias"):
                renamed[f"blocks.{i}.{j}.linear.{kind}"] = state.get(f"{i}.{j}.linear.{kind}")  # type: ignore[assignment]
        renamed[f"lm_heads.{i}.weight"] = state.get(f"{i}.{num_layers}.weight")  # type: ignore[assignment]
    checkpoint.load_state(heads, {k: v for k, v in renamed.items() if v is not None}, file, "Medusa")
    return heads


def load_heads(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> MedusaHeads:
    """Medusa heads from a directory in either layout (see the module docstring)."""
    return checkpoint.load_either(path, LAYOUTS, _load_ours, _load_reference, dtype, device)


def shipped_heads(model_name: str) -> Path:
    """The heads directory shipped for the model `model_name` (a short name), or a clear error."""
    return checkpoint.shipped(model_name, "medusa", WEIGHTS, "Medusa heads", plural=True)


def check_fits(heads: MedusaHeads, target: Transformer, source: str = "Medusa heads") -> None:
    """Heads read the target's hidden states and produce its token ids: both sizes must match."""
    checkpoint.check_fits(heads.hidden_size, heads.vocab_size, target, source, plural=True)


# ------------------------------------------------------------------------------------------------
# Trees


def best_tree(rank_probs: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """The `num_nodes` paths of largest acceptance probability, as medusa_choices.

    `rank_probs[k][r]` is the probability that head k's r-th ranked token is the right one
    (Medusa's tree construction, Sec. 2.2.1, assuming heads are right independently). A path's
    probability is the product along it, and its expected contribution to τ; so the tree of
    largest expected τ with n nodes is the n most probable paths. Ranks are made non-increasing
    first, so a path's probability never exceeds its parent's or its elder sibling's and a
    best-first walk (pop the best path; offer its first child and its next sibling) is exact and
    yields a prefix-closed tree.
    """
    probs: list[list[float]] = []
    for row in rank_probs:
        cleaned, low = [], 1.0
        for p in row:
            low = min(low, max(float(p), 0.0))
            cleaned.append(low)
        probs.append(cleaned)
    out: list[list[int]] = []
    # Entries: (-probability, path, probability of the path's parent).
    heap: list[tuple[float, list[int], float]] = []
    if probs and probs[0]:
        heap.append((-probs[0][0], [0], 1.0))
    while heap and len(out) < num_nodes:
        neg, path, above = heapq.heappop(heap)
        out.append(path)
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(probs[depth]):
            heapq.heappush(heap, (-above * probs[depth][rank + 1], [*path[:-1], rank + 1], above))
        if depth + 1 < len(probs) and probs[depth + 1]:
            heapq.heappush(heap, (neg * probs[depth + 1][0], [*path, 0], -neg))
    return out


def default_choices(num_heads: int, num_nodes: int = DEFAULT_TREE_NODES) -> list[list[int]]:
    """A tree for heads that come without one: `best_tree` under assumed head accuracies.

    Assumed: head k's top-1 is right 60% x 0.7^k of the time and each further rank half as often
    as the one before, roughly what trained heads reach; the shape resembles Medusa's published
    trees (wide at depth 1, a spine along the top-1 path).
    """
    ranks = [[0.6 * 0.7**k * 0.5**r for r in range(10)] for k in range(num_heads)]
    return best_tree(ranks, num_nodes)


def check_choices(choices: Sequence[Sequence[int]], num_heads: int, vocab_size: int) -> None:
    """Choices must fit the heads: depth <= K (head d-1 drafts depth d) and ranks < V."""
    from_choices(choices)  # structure: non-empty paths of non-negative integers
    deep = [list(c) for c in choices if len(c) > num_heads]
    if deep:
        raise SpecDecodeError(
            f"medusa_choices path {deep[0]} is {len(deep[0])} deep but the heads draft only "
            f"{num_heads} tokens (one depth per head)"
        )
    wide = [list(c) for c in choices if max(c) >= vocab_size]
    if wide:
        raise SpecDecodeError(
            f"medusa_choices path {wide[0]} asks for top-k rank {max(wide[0])}, beyond the "
            f"vocabulary of {vocab_size} tokens"
        )


# ------------------------------------------------------------------------------------------------
# The drafter


class MedusaDrafter(LastRowDrafter):
    """Drafts the Medusa tree from the hidden state of the row that produced the root.

    Made per request. `choices` None: the heads' own fitted tree, else `default_choices`.
    `typical` (posterior_threshold, posterior_alpha) switches sampled requests to typical
    acceptance, which is LOSSY (see `verify.verify_typical`); None keeps exact verification.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        target: Transformer,
        choices: Sequence[Sequence[int]] | None = None,
        typical: tuple[float, float] | None = None,
    ) -> None:
        check_fits(heads, target)
        if choices is None:  # the fitted tree is best-first: its first nodes are the best smaller tree
            fitted = heads.choices[:DEFAULT_TREE_NODES] if heads.choices is not None else None
            choices = fitted if fitted is not None else default_choices(heads.num_heads)
        self.vocab = None if heads.draft_vocab is None else heads.draft_vocab.to(target.device)  # (V',)
        check_choices(choices, heads.num_heads, heads.vocab_size if self.vocab is None else len(self.vocab))
        self.heads = heads
        self.target = target
        shape = from_choices(choices)
        self.parents = shape.parents  # (N,)
        self.node_head = shape.depths - 1  # (N,) which head drafts each node
        self.node_rank = shape.topk  # (N,) its rank among that head's guesses
        n = shape.num_nodes
        self.num_heads_used = int(shape.depths.max()) if n else 0
        self.width = int(shape.topk.max()) + 1 if n else 0
        self.max_nodes = max(n, 1)  # >= 1: see `propose` for a request whose prompt is one token
        if typical is not None:
            threshold, alpha = typical
            self.sampling_verifier = functools.partial(
                verify_typical, posterior_threshold=threshold, posterior_alpha=alpha
            )
        self.hidden: Tensor | None = None  # (C,) the row whose target output is the current root

    @property
    def max_chain(self) -> int:
        """One token a head: a budgeted step drafts each head's top guess as a chain."""
        return max(self.num_heads_used, 1)

    @torch.inference_mode()
    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        if self.num_heads_used == 0:
            return Proposal(DraftTree.empty())
        if (opening := opening_proposal(req, self.hidden is not None)) is not None:
            return opening
        room = req.max_len - len(req.all_ids)  # draft nodes the request's cache still holds
        if budget is not None:
            room = min(room, budget)
        chain = self.chains(budget)  # each head's top guess, in a chain
        used = min(room, self.num_heads_used) if chain else self.num_heads_used  # D heads
        if self.heads.lm_heads is None:
            # The target's head over the draft vocabulary, approximate where the kernels offer
            # that: a draft only picks candidates, the verifier decides.
            feats = self.heads.features(self.hidden, used)  # (D, C)
            logits = self.heads.draft_head(self.target)(feats)  # (D, V')
        else:
            logits = self.heads(self.hidden, None, used)  # (D, V)
        if chain:
            return Proposal(DraftTree.chain(self.ids(logits.argmax(dim=-1))))
        top = self.ids(logits.topk(self.width, dim=-1).indices)  # (D, W)
        device = top.device
        tokens = top[self.node_head.to(device), self.node_rank.to(device)]  # (N,)
        n = min(tokens.shape[0], room)  # nodes are in topological order: a prefix is a tree
        return Proposal(DraftTree(tokens[:n], self.parents[:n].to(device)))

    def ids(self, columns: Tensor) -> Tensor:
        """Columns of the draft head's logits -> the token ids they stand for."""
        return columns if self.vocab is None else self.vocab[columns]
