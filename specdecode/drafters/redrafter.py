"""ReDrafter: a small recurrent drafter on the target's last hidden state, searched by beams.

Cheng et al. 2024, "Recurrent Drafter for Fast Speculative Decoding in Large Language Models"
(arXiv 2403.09919). The drafter reads two things: the target's final hidden state h at the row
that produced the root (as Medusa, see `drafters/medusa.py` for that bookkeeping), and a
recurrent state s that it updates from each token of the beam it is extending, starting from
the root itself:

    s_0 = 0,   s_k = SiLU(W e(x_k) + U s_{k-1} + b)       x_1 = the root, e = target's embedding
    logits_k = LMHead(ResBlocks(Proj([h, s_k])))          the token after x_k

so unlike Medusa's independent heads each guess knows the guesses before it. Worked example,
prompt "A B C" (root C): h = h(B), whose LM-head output was C; s_1 = f(e(C)) predicts the token
after C, say D; s_2 = f(e(D), s_1) predicts the one after D.

**Beam search** (`beam_search`): `beam_width` beams of `beam_length` tokens counting the root, as
the reference implementation counts them, so each beam drafts `beam_length - 1` tokens. Each
step extends every beam by every token and keeps the `beam_width` best by summed log
probability. **Merging** (`merge_beams`): beams share prefixes (often their first tokens), so
the tree has one node per distinct prefix and the target checks each prefix once; the verifier's
walk down the tree then finds the longest accepted beam.

**Draft vocabulary.** Each beam step multiplies a few rows by the whole LM head; on a CPU that
costs the bytes read (113 MB for SmolLM2's 49152 x 576 float32 head), four times a step. A
drafter sharing the target's head may carry `draft_vocab`, the K token ids it may draft (the
most frequent ones in its training answers): it then reads only those K columns, and scores
beams by the softmax over them. The verifier is untouched, so output stays exact; only tokens
outside the K can never be drafted.

**Draft probabilities.** Beam search is deterministic: given the context, which tokens become
nodes, and in which sibling order, is fixed, so each node's token is a point mass given
everything before it. The tree therefore carries no `draft_probs` and `verify_sampling` treats
the nodes as point masses, which is exact (its docstring's induction). Reporting the drafter's
softmax at the parent as q instead would be wrong: the tokens were not drawn from it, and the
distribution test in tests/test_redrafter.py fails that variant.

Checkpoints are directories, in one of two layouts:

- specdecode's: `redrafter.safetensors` + `config.json` (`method` "redrafter", `hidden_size`,
  `vocab_size`, `exit_dim`, `num_layers`, `rnn`, `shared_lm_head`, `target`). A drafter sharing
  the target's LM head (exit_dim = hidden size) stores no LM-head weights.
- the reference implementation's (apple/ml-recurrent-drafter, a transformers `save_pretrained`
  directory): `model.safetensors` or `pytorch_model.bin` with `input_proj.*` (absent when
  exit_dim = 2 x hidden size), `lm_head.{j}.linear.*` for residual block j,
  `lm_head.{num_draft_layers}.weight` for its LM head, `rnn_u.*`, `rnn_w.weight`, next to a
  `config.json` with `model_type` "recurrent_drafting_drafter", `hidden_size`, `vocab_size`,
  `exit_dim`, `num_draft_layers`, `rnn`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.drafters import checkpoint
from specdecode.drafters.base import LastRowDrafter, Proposal, opening_proposal
from specdecode.drafters.checkpoint import CONFIG
from specdecode.drafters.medusa import ResBlock
from specdecode.errors import SpecDecodeError
from specdecode.layers.lm_head import DraftHead
from specdecode.models.transformer import Transformer
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.request import Request

# The target's LM head a shared-head drafter reads: (C, V) weights, or their product (drafting).
SharedHead = Tensor | Callable[[Tensor], Tensor]

WEIGHTS = "redrafter.safetensors"
REFERENCE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
REFERENCE_MODEL_TYPE = "recurrent_drafting_drafter"
LAYOUTS = checkpoint.Layouts(
    "ReDrafter", "redrafter", "a ReDrafter", WEIGHTS, REFERENCE_WEIGHTS,
    f" + a {CONFIG} of model_type {REFERENCE_MODEL_TYPE!r} (apple/ml-recurrent-drafter)",
)  # fmt: skip


class ReDrafterHead(nn.Module):
    """The recurrent drafter's weights: the state update, the input projection, the residual
    blocks and (unless shared with the target) an LM head.

    `rnn` False is the reference's simpler variant, s_k = s_{k-1} + e(x_k). `exit_dim` is the
    width of the residual blocks: the hidden size when sharing the target's LM head (the
    projection then maps [h, s] down to it), 2 x hidden size for the reference's own-head
    drafters (no projection).

    Built to start from the target's own next-token guess: the projection passes h through and
    ignores s, the blocks are the identity; training learns to use the state.
    """

    WEIGHTS: ClassVar[str] = WEIGHTS  # its weights file (`checkpoint.save_head`)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_layers: int = 2,
        exit_dim: int | None = None,
        rnn: bool = True,
        shared_lm_head: bool = True,
        draft_vocab_size: int = 0,
    ) -> None:
        super().__init__()
        exit_dim = hidden_size if exit_dim is None else exit_dim
        if num_layers < 0 or hidden_size < 1 or vocab_size < 1 or exit_dim < 1:
            raise SpecDecodeError(
                f"ReDrafter needs positive sizes and >= 0 layers, got hidden {hidden_size}, "
                f"vocabulary {vocab_size}, exit_dim {exit_dim}, layers {num_layers}"
            )
        if shared_lm_head and exit_dim != hidden_size:
            raise SpecDecodeError(
                f"a ReDrafter sharing the target's LM head needs exit_dim = hidden size {hidden_size}, "
                f"got {exit_dim}"
            )
        self.hidden_size, self.vocab_size, self.exit_dim = hidden_size, vocab_size, exit_dim
        self.num_layers, self.rnn, self.shared_lm_head = num_layers, rnn, shared_lm_head
        if rnn:
            self.rnn_w = nn.Linear(hidden_size, hidden_size, bias=False)
            self.rnn_u = nn.Linear(hidden_size, hidden_size, bias=True)
        self.input_proj: nn.Linear | None = None
        if exit_dim != 2 * hidden_size:
            self.input_proj = nn.Linear(2 * hidden_size, exit_dim, bias=True)
            with torch.no_grad():
                self.input_proj.weight.zero_()
                self.input_proj.bias.zero_()
                self.input_proj.weight[:, :hidden_size].copy_(torch.eye(exit_dim, hidden_size))
        self.blocks = nn.Sequential(*(ResBlock(exit_dim) for _ in range(num_layers)))
        self.lm_head = None if shared_lm_head else nn.Linear(exit_dim, vocab_size, bias=False)
        if draft_vocab_size and not shared_lm_head:
            raise SpecDecodeError("a ReDrafter draft vocabulary needs the shared LM head")
        # (K,) the token ids it may draft; empty = the whole vocabulary (see the module docstring).
        # Not trained, so not in the state dict (nor in training checkpoints); `save_head` stores it.
        self.register_buffer(
            "draft_vocab", torch.arange(draft_vocab_size, dtype=torch.long), persistent=False
        )
        self._sliced: tuple[tuple[int, int, torch.dtype], Tensor] | None = None
        self._draft_head = checkpoint.DraftColumns()

    def lm_weight_t(self, target_weight_t: Tensor) -> Tensor:
        """The (C, K) columns of the target's (C, V) LM head for `draft_vocab` (all V without
        one), cut once per head weight (storage, version and dtype)."""
        if self.draft_vocab.numel() == 0:
            return target_weight_t
        key = (target_weight_t.data_ptr(), target_weight_t._version, target_weight_t.dtype)
        if self._sliced is None or self._sliced[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                cols = target_weight_t.detach()[:, self.draft_vocab.to(target_weight_t.device)]
            self._sliced = (key, cols.contiguous())
        return self._sliced[1]

    def draft_head(self, target: Transformer) -> DraftHead:
        """The target's LM head over `draft_vocab` (all of it without one) as its kernels read
        it for drafts (`checkpoint.DraftColumns`)."""
        return self._draft_head(target, self.draft_vocab if self.draft_vocab.numel() else None)

    def step(self, state: Tensor, embedding: Tensor) -> Tensor:
        """(..., C) state and (..., C) embedding of the beam's last token -> (..., C) next state."""
        if self.rnn:
            return F.silu(self.rnn_w(embedding) + self.rnn_u(state))
        return state + embedding

    def features(self, context: Tensor, state: Tensor) -> Tensor:
        """(..., C) target hidden state and (..., C) recurrent state -> (..., E) LM-head input."""
        x = torch.cat([context, state], dim=-1)  # (..., 2C)
        if self.input_proj is not None:
            x = self.input_proj(x)
        return self.blocks(x)

    def forward(self, context: Tensor, state: Tensor, shared_weight_t: SharedHead | None = None) -> Tensor:
        """(..., C), (..., C) -> (..., V) logits of the token after the beam's last token.

        `shared_weight_t` (C, V) is the target's LM head (`Transformer.head_weight_t()`),
        required when the drafter shares it; the features are cast to its dtype (a bfloat16
        copy keeps the big matmul in bfloat16 while training). Drafting passes the target's own
        product over the draft vocabulary instead (`draft_head`)."""
        feats = self.features(context, state)
        if self.lm_head is None:
            if shared_weight_t is None:
                raise ValueError("this drafter shares the target's LM head: pass its weight_t")
            if not isinstance(shared_weight_t, Tensor):
                return shared_weight_t(feats.reshape(-1, feats.shape[-1])).view(*feats.shape[:-1], -1)
            return feats.to(shared_weight_t.dtype) @ shared_weight_t
        return self.lm_head(feats)

    def saved(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        vocab = {checkpoint.DRAFT_VOCAB: self.draft_vocab.to("cpu")} if self.draft_vocab.numel() else {}
        return self.config(), vocab

    def config(self) -> dict[str, Any]:
        return {
            "method": "redrafter",
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "exit_dim": self.exit_dim,
            "num_layers": self.num_layers,
            "rnn": self.rnn,
            "shared_lm_head": self.shared_lm_head,
            "draft_vocab_size": int(self.draft_vocab.numel()),
        }


# ------------------------------------------------------------------------------------------------
# Beam search and the tree


@torch.inference_mode()
def beam_search(
    head: ReDrafterHead,
    context: Tensor,
    root: int,
    embed: Callable[[Tensor], Tensor],
    head_weight_t: SharedHead | None,
    width: int,
    depth: int,
) -> tuple[Tensor, Tensor]:
    """The `width` most likely continuations of `root`, `depth` tokens each, best first.

    `context` (C,) is the target's hidden state that produced the root; `embed` the target's
    input embedding (ids (...) -> (..., C)); `head_weight_t` (C, V) its LM head (for a shared-head drafter),
    or its product over the draft vocabulary already (`ReDrafterHead.draft_head`).
    Returns beams (B, depth) long and their summed log probabilities (B,), B <= width (fewer
    only when the vocabulary is smaller than the width). The first step extends the root
    alone, so no two beams are ever the same sequence. A head with a draft vocabulary drafts
    only its tokens (`ReDrafterHead.lm_weight_t`).
    """
    vocab_ids = head.draft_vocab if head.draft_vocab.numel() else None  # (K,) or all V
    if head.lm_head is None and isinstance(head_weight_t, Tensor):
        head_weight_t = head.lm_weight_t(head_weight_t)  # (C, K)
    device = context.device
    state = torch.zeros(1, head.hidden_size, dtype=context.dtype, device=device)  # (B, C)
    last = torch.tensor([root], device=device)  # (B,)
    scores = torch.zeros(1, device=device)  # (B,) float32
    beams = torch.zeros(1, 0, dtype=torch.long, device=device)  # (B, d)
    for _ in range(depth):
        state = head.step(state, embed(last))  # (B, C)
        logits = head(context.expand_as(state), state, head_weight_t)  # (B, V)
        total = scores[:, None] + torch.log_softmax(logits.float(), dim=-1)  # (B, V)
        vocab = total.shape[1]
        scores, flat = total.flatten().topk(min(width, total.numel()))  # (B',)
        parent, last = flat // vocab, flat % vocab
        if vocab_ids is not None:
            last = vocab_ids[last]
        beams = torch.cat([beams[parent], last[:, None]], dim=1)
        state = state[parent]
    return beams, scores


def merge_beams(beams: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Beams (token lists after the root) -> (tokens, parents) of the tree with one node per
    distinct prefix, in the numbering of `DraftTree` (parents: 0 = root).

    Nodes come depth by depth and, within a depth, in the order of the first beam holding
    them, so a parent always precedes its children and any first n nodes form a tree.
    Example: beams [[5, 6, 7], [5, 8], [9]] -> tokens [5, 9, 6, 8, 7], parents [0, 0, 1, 1, 3].
    """
    node_of: dict[tuple[int, ...], int] = {(): 0}
    tokens: list[int] = []
    parents: list[int] = []
    for depth in range(1, max((len(b) for b in beams), default=0) + 1):
        for beam in beams:
            if len(beam) < depth:
                continue
            prefix = tuple(beam[:depth])
            if prefix not in node_of:
                tokens.append(prefix[-1])
                parents.append(node_of[prefix[:-1]])
                node_of[prefix] = len(tokens)
    return tokens, parents


# ------------------------------------------------------------------------------------------------
# Checkpoints


save_head = checkpoint.save_head  # (head, out, target, dtype=float16, extra=None) -> out


def _build(config: dict[str, Any], source: Path, layers_key: str, shared: bool) -> ReDrafterHead:
    try:
        return ReDrafterHead(
            int(config["hidden_size"]),
            int(config["vocab_size"]),
            int(config[layers_key]),
            int(config["exit_dim"]),
            bool(config.get("rnn", True)),
            shared,
            int(config.get("draft_vocab_size", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecDecodeError(f"{source} is not a ReDrafter config ({exc!r})") from None


def _load_reference(file: Path, config: dict[str, Any]) -> ReDrafterHead:
    """The reference layout: `lm_head` is `Sequential(ResBlock * L, Linear(E, V))`."""
    head = _build(config, file.parent / CONFIG, "num_draft_layers", shared=False)
    # A drafter saved from the reference's training wrapper carries a "drafter." prefix.
    state = {k.removeprefix("drafter."): v for k, v in checkpoint.read_tensors(file, "ReDrafter").items()}
    renamed: dict[str, Tensor] = {}
    for name, tensor in state.items():
        parts = name.split(".")
        if parts[0] != "lm_head":
            renamed[name] = tensor
        elif parts[1] == str(head.num_layers):
            renamed["lm_head." + ".".join(parts[2:])] = tensor
        else:
            renamed["blocks." + ".".join(parts[1:])] = tensor
    checkpoint.load_state(head, renamed, file, "ReDrafter")
    return head


def load_head(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> ReDrafterHead:
    """A ReDrafter from a directory in either layout (see the module docstring)."""

    def reference_ok(config: dict[str, Any]) -> bool:
        return config.get("model_type") == REFERENCE_MODEL_TYPE

    return checkpoint.load_either(path, LAYOUTS, _load_ours, _load_reference, dtype, device, reference_ok)


def _load_ours(root: Path, config: dict[str, Any]) -> ReDrafterHead:
    head = _build(config, root / CONFIG, "num_layers", bool(config.get("shared_lm_head", True)))
    tensors = checkpoint.read_tensors(root / WEIGHTS, "ReDrafter")
    vocab = tensors.pop(checkpoint.DRAFT_VOCAB, head.draft_vocab)
    if vocab.shape != head.draft_vocab.shape:
        raise SpecDecodeError(f"{root / WEIGHTS}: draft_vocab does not match draft_vocab_size in {CONFIG}")
    checkpoint.load_state(head, tensors, root / WEIGHTS, "ReDrafter")
    head.draft_vocab = vocab.long()
    return head


def shipped_head(model_name: str) -> Path:
    """The ReDrafter directory shipped for the model `model_name` (a short name), or a clear error."""
    return checkpoint.shipped(model_name, "redrafter", WEIGHTS, "ReDrafter")


def check_fits(head: ReDrafterHead, target: Transformer, source: str = "ReDrafter") -> None:
    """The drafter reads the target's hidden states and embeddings and produces its token ids."""
    checkpoint.check_fits(head.hidden_size, head.vocab_size, target, source)


# ------------------------------------------------------------------------------------------------
# The drafter


class ReDrafter(LastRowDrafter):
    """Drafts the merged beams of a beam search from the hidden state that produced the root.

    Made per request. `beam_length` counts the root (the reference's convention): each beam
    drafts `beam_length - 1` tokens, and the tree has at most `beam_width * (beam_length - 1)`
    nodes, fewer where beams share prefixes.
    """

    def __init__(self, head: ReDrafterHead, target: Transformer, beam_width: int, beam_length: int) -> None:
        check_fits(head, target)
        if beam_width < 1 or beam_length < 2:
            raise SpecDecodeError(
                f"redrafter: beam_width must be >= 1 and beam_length >= 2, got {beam_width}, {beam_length}"
            )
        self.head = head
        self.target = target
        self.width = beam_width
        self.depth = beam_length - 1
        self.max_nodes = beam_width * self.depth
        self.hidden: Tensor | None = None  # (C,) the row whose target output is the current root

    @property
    def max_chain(self) -> int:
        """A beam's length: a budgeted step searches one beam."""
        return self.depth

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        if (opening := opening_proposal(req, self.hidden is not None)) is not None:
            return opening
        room = req.max_len - len(req.all_ids)  # draft nodes the request's cache still holds
        if budget is not None:
            room = min(room, budget)
        if room <= 0:
            return Proposal(DraftTree.empty())
        chain = self.chains(budget)  # one beam: the best chain
        beams, _ = beam_search(
            self.head,
            self.hidden,
            req.root,
            self.target.embed,
            self.head.draft_head(self.target) if self.head.lm_head is None else None,
            1 if chain else self.width,
            min(self.depth, room),  # one step a depth: none past what the budget verifies
        )
        tokens, parents = merge_beams(beams.tolist())
        n = min(len(tokens), room)  # nodes come depth by depth: a prefix is a tree
        return Proposal(
            DraftTree(torch.tensor(tokens[:n], dtype=torch.long), torch.tensor(parents[:n], dtype=torch.long))
        )
