"""EAGLE: a one-layer draft head that extrapolates the target's features, drafting trees.

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (EAGLE-1,
static tree) and "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees".

Features: f_t is the target's final hidden state at position t (after the final norm; the row
whose LM-head output is the token at t+1). The head reads *pairs* (token x_{t+1}, feature f_t),
whose embedding and feature are concatenated and projected (fc, 2C -> C), runs one decoder
layer (attention over the earlier pairs, in its own 1-layer KV cache, at position t), and
outputs a guess of f_{t+1}; the target's frozen LM head turns it into a distribution over
x_{t+2}. The token fed with a feature resolves the uncertainty of which token was sampled from
it, which is why EAGLE drafts better than heads that see features only (Medusa).

Worked example, tokens x_0..x_n with root x_n (decided, not yet run by the target), features
f_0..f_{n-1} known: the head's cache holds pairs 0..n-1, the last being (x_n, f_{n-1}); its
output there, g_n, guesses f_n, and LM(g_n) proposes depth-1 tokens y. Depth 2: pairs
(y, g_n) at position n, one per depth-1 node, each attending to the cache and its own
ancestors' pairs (tree attention), give g_{n+1|y} and LM of it proposes y's children; and so
on, one head forward per depth over all nodes of that depth. After verification the target's
features of the root and the accepted path (rows of `StepResult.hidden`) replace the guesses:
the tree's pairs are dropped (rollback) and the m+1 new pairs (a_1, f_n), ..., (bonus, f_{n+m})
are appended in one forward; nothing earlier is re-run. (They wait until the head next drafts:
a step without a draft budget runs no head forward, and the pairs of several such steps run in
one.)

Trees (both lossless, the verifier decides; see `EagleDrafter`):
- EAGLE-1: a static tree `eagle_choices` (the medusa_choices format, `tree.from_choices`): the
  node at path (r_1, ..., r_d) holds the r_d-th candidate under its parent.
- EAGLE-2: grown by confidence: `depth` levels; at each, the `top_k` frontier nodes of highest
  cumulative draft probability are expanded into `top_k` children each; then the `total_tokens`
  nodes of highest cumulative probability are verified (ancestors of a kept node are kept).

Checkpoints are directories in one of two layouts:
- specdecode's: `eagle.safetensors` + `config.json` (`method` "eagle", `hidden_size`,
  `vocab_size`, `target`, the layer's shape, `fc_bias`, `input_norm`, optionally the fitted
  `eagle_choices`). The embedding and LM head are the target's, never stored.
- the EAGLE reference's: `pytorch_model.bin` or `model.safetensors` holding `fc.weight`
  (+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight` (+ q/k/v biases for Qwen2),
  `layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight` and
  sometimes `embed_tokens.weight` (a copy of the target's, ignored), next to a Llama-style
  `config.json`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from specdecode.attention import AttentionPlan, Segment
from specdecode.drafters import checkpoint
from specdecode.drafters.base import Drafter, Proposal, StepResult, opening_proposal
from specdecode.drafters.checkpoint import CONFIG
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import KVCache
from specdecode.layers.linear import Dense
from specdecode.layers.lm_head import DraftHead
from specdecode.layers.rotary import Rotary
from specdecode.models.config import ModelConfig
from specdecode.models.transformer import Block, OneCallLayers, Transformer
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.spec_config import DEFAULT_EAGLE2
from specdecode.tree import DraftTree, from_choices

if TYPE_CHECKING:
    from specdecode.request import Request

WEIGHTS = "eagle.safetensors"
REFERENCE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
LAYOUTS = checkpoint.Layouts(
    "EAGLE head", "eagle", "an EAGLE", WEIGHTS, REFERENCE_WEIGHTS, f" + {CONFIG} (EAGLE reference)"
)
LAYER_KEYS = (
    "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias",
)  # fmt: skip


class EagleHead(nn.Module):
    """fc over [embedding of x_{t+1}, f_t] (2C -> C), then one decoder layer (the model's own
    `Block`); outputs the guess of f_{t+1}. The embedding and LM head are the target's, passed in.

    `layer` is the shape of the layer as a 1-layer `ModelConfig` (its `vocab_size` names the
    target's vocabulary). `input_norm` False: EAGLE-1's layer has no norm before attention.
    `choices`: the static tree fitted at training time, if any. `draft_vocab` (V',) long: the
    token ids the head drafts from (None: all), as EAGLE-3 does; on a CPU the LM head is most of
    a draft step's cost and answers use a small part of a 49k vocabulary.
    """

    WEIGHTS: ClassVar[str] = WEIGHTS  # its weights file (`checkpoint.save_head`)

    def __init__(
        self,
        layer: ModelConfig,
        fc_bias: bool = True,
        input_norm: bool = False,
        choices: Sequence[Sequence[int]] | None = None,
        draft_vocab: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.layer_config = dataclasses.replace(layer, num_layers=1)
        self.draft_vocab = None if draft_vocab is None else torch.unique(draft_vocab.long())  # (V',) sorted
        self._draft_head = checkpoint.DraftColumns()
        self.hidden_size, self.vocab_size = layer.hidden_size, layer.vocab_size
        self.fc_bias, self.input_norm = fc_bias, input_norm
        self.choices = None if choices is None else [list(c) for c in choices]
        self.fc = Dense(2 * layer.hidden_size, layer.hidden_size, bias=fc_bias)
        self.layer = Block(self.layer_config, 0, input_norm=input_norm)
        self.rotary = Rotary(self.layer_config)
        self.one_call = OneCallLayers([self.layer])  # the layer in one kernel call, where it can

    @classmethod
    def for_target(cls, target: ModelConfig) -> EagleHead:
        """A fresh head shaped like one layer of `target` (what training starts from)."""
        return cls(dataclasses.replace(target, num_layers=1))

    def draft_head(self, target: Transformer) -> DraftHead:
        """The target's LM head over the draft vocabulary, as the target's kernels read it for
        drafts (`checkpoint.DraftColumns`)."""
        return self._draft_head(target, self.draft_vocab)

    def new_cache(self, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache(self.layer_config, max_len, 1, dtype, device)

    def forward(
        self,
        embeds: Tensor,  # (B, T, C) target embeddings of x_{t+1}
        features: Tensor,  # (B, T, C) f_t (target features or the head's own guesses)
        positions: Tensor,  # (B, T) long: t
        plan: AttentionPlan,
    ) -> Tensor:
        """Guesses of f_{t+1}, (B, T, C); writes the pairs' keys/values to the plan's slots (the
        caller commits the plan)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        one_call = self.one_call(x, cos, sin, plan)  # ~15 Python calls fewer a draft depth
        return one_call if one_call is not None else self.layer(x, cos, sin, plan)

    def run(
        self,
        cache: KVCache,
        embeds: Tensor,  # (T, C)
        features: Tensor,  # (T, C)
        positions: Tensor,  # (T,) long
        mask: Tensor | None = None,  # (T, cache.length + T) bool; None = causal chain
    ) -> Tensor:
        """One sequence's pairs over `cache` -> (T, C) guesses (the drafter's forward)."""
        plan = AttentionPlan([Segment.append(cache, embeds.shape[0], mask)])
        out = self(embeds[None], features[None], positions[None], plan)[0]
        plan.commit()
        return out

    def saved(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        vocab = {} if self.draft_vocab is None else {checkpoint.DRAFT_VOCAB: self.draft_vocab.to("cpu")}
        fitted = {} if self.choices is None else {"eagle_choices": self.choices}
        return {**self.config(), **fitted}, vocab

    def config(self) -> dict[str, Any]:
        layer = self.layer_config
        return {
            "method": "eagle",
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "arch": layer.arch,
            **{k: getattr(layer, k) for k in LAYER_KEYS},
            "fc_bias": self.fc_bias,
            "input_norm": self.input_norm,
            "draft_vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
        }


# ------------------------------------------------------------------------------------------------
# Checkpoints


save_head = checkpoint.save_head  # (head, out, target, dtype=float16, extra=None) -> out


def _load_ours(path: Path, config: dict[str, Any]) -> EagleHead:
    try:
        layer = ModelConfig(
            arch=config.get("arch", "llama"),
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=1,
            **{k: config[k] for k in LAYER_KEYS},
        )
        state = checkpoint.read_tensors(path / WEIGHTS, "EAGLE")
        vocab = checkpoint.draft_vocab(state, layer.vocab_size, path / WEIGHTS)
        head = EagleHead(
            layer, bool(config["fc_bias"]), bool(config["input_norm"]), config.get("eagle_choices"), vocab
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecDecodeError(f"{path / CONFIG} is not a specdecode EAGLE config ({exc!r})") from None
    checkpoint.load_state(head, state, path / WEIGHTS, "EAGLE")
    return head


def _load_reference(file: Path, config: dict[str, Any]) -> EagleHead:
    """The EAGLE reference layout: a Llama/Qwen2 decoder layer named as in Hugging Face files
    (q/k/v and gate/up separate, (out, in) matrices) under `layers.0.`, and `fc`."""
    state = checkpoint.read_tensors(file, "EAGLE")
    if "fc.weight" not in state or "layers.0.self_attn.q_proj.weight" not in state:
        raise SpecDecodeError(f"{file} is not an EAGLE checkpoint: no fc.weight / layers.0 weights")
    hf = dict(config)
    hf.setdefault("model_type", "llama")
    hf["num_hidden_layers"] = 1
    if "layers.0.self_attn.q_proj.bias" in state:
        hf["attention_bias"] = True
    try:
        layer = ModelConfig.from_hf(hf)
    except KeyError as exc:
        raise SpecDecodeError(f"{file.parent / CONFIG} lacks {exc} (a Llama-style config)") from None
    fc_bias = "fc.bias" in state
    head = EagleHead(layer, fc_bias=fc_bias, input_norm="layers.0.input_layernorm.weight" in state)
    p, a = "layers.0.", "layers.0.self_attn."

    def take(name: str) -> Tensor:
        if name not in state:
            raise SpecDecodeError(f"{file} is missing EAGLE weight {name!r}")
        return state[name]

    ours = {
        "fc.weight_t": take("fc.weight").t(),
        "layer.qkv.weight_t": torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]).t(),
        "layer.o.weight_t": take(a + "o_proj.weight").t(),
        "layer.mlp_norm.weight": take(p + "post_attention_layernorm.weight"),
        "layer.gate_up.weight_t": torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        ).t(),
        "layer.down.weight_t": take(p + "mlp.down_proj.weight").t(),
    }
    if fc_bias:
        ours["fc.bias"] = state["fc.bias"]
    if layer.attention_bias:
        ours["layer.qkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
    if head.input_norm:
        ours["layer.attn_norm.weight"] = state[p + "input_layernorm.weight"]
    checkpoint.load_state(head, ours, file, "EAGLE")
    return head


def load_head(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> EagleHead:
    """An EAGLE head from a directory in either layout (see the module docstring), trainable: bind
    the target's kernels (`layers.bind_kernels`) to draft with it."""
    return checkpoint.load_either(path, LAYOUTS, _load_ours, _load_reference, dtype, device)


def shipped_head(model_name: str) -> Path:
    """The EAGLE head directory shipped for the model `model_name` (a short name), or a clear error."""
    return checkpoint.shipped(model_name, "eagle", WEIGHTS, "EAGLE head")


def check_fits(head: EagleHead, target: Transformer, source: str = "the EAGLE head") -> None:
    """The head reads the target's features and embeddings and drafts its token ids."""
    checkpoint.check_fits(head.hidden_size, head.vocab_size, target, source)


# ------------------------------------------------------------------------------------------------
# Trees


def default_choices(num_nodes: int = 24, depth: int = 5) -> list[list[int]]:
    """A static tree for a head that comes without a fitted one: Medusa's `best_tree` under
    assumed accuracies (top-1 right 70% of the time at every depth, each further rank half as
    often as the one before; a trained head's measured figures replace this)."""
    from specdecode.drafters.medusa import best_tree

    return best_tree([[0.7 * 0.5**r for r in range(10)] for _ in range(depth)], num_nodes)


def check_choices(choices: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Structure (non-empty paths of non-negative ranks, `from_choices`) and ranks < V."""
    from_choices(choices)
    wide = [list(c) for c in choices if max(c) >= vocab_size]
    if wide:
        raise SpecDecodeError(
            f"eagle_choices path {wide[0]} asks for top-k rank {max(wide[0])}, beyond the "
            f"vocabulary of {vocab_size} tokens"
        )


@dataclass
class _Node:
    """A draft node while the tree grows (index i in `_Growth.nodes` is node i+1 of the tree
    before selection; parent -1 is the root)."""

    token: int
    parent: int
    depth: int
    rank: int  # among its parent's candidates, 0 = drawn first
    score: float  # cumulative log draft probability of its slot (see `_Growth.children`)
    q: Tensor | None  # (V',) the distribution its token was drawn from (sampling only)
    slot: int | None = None  # its pair's slot in the head cache, once expanded


class _Growth:
    """One step's tree under construction: candidates, expansion by head forwards, selection.

    Candidates of a parent with draft distribution q (the head's softmax, or for sampled
    requests the same temperature/top-k/top-p processing as the target's) are its top-k tokens
    (greedy) or k tokens drawn from q without replacement (sampling; Gumbel top-k, in draw
    order). A slot's score is log of the rank-th largest q value: for greedy exactly the
    token's probability; for sampling a stand-in that does not depend on which token was drawn,
    so which nodes are kept never depends on a node's own token, and the verifier's induction
    over siblings holds (see `EagleDrafter`). Sibling j's declared distribution is q without
    the j earlier siblings' tokens, renormalised: what it was drawn from, given them.
    """

    def __init__(self, drafter: EagleDrafter, req: Request) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.params: SamplingParams = req.params
        self.generator = req.generator
        self.nodes: list[_Node] = []
        self.committed = drafter.cache.length  # n: pairs of the decided tokens
        assert drafter.last is not None
        self.guess: dict[int, Tensor] = {-1: drafter.last}  # node -> its head output (C,)

    def root_distribution(self) -> Tensor:
        """(V,) the draft distribution of depth 1, from the head's output at the last decided pair."""
        assert self.drafter.last is not None
        return self.distributions(self.drafter.last[None])[0]

    def distributions(self, guesses: Tensor) -> Tensor:
        """(R, C) head outputs -> (R, V') draft distributions over the draft vocabulary."""
        logits = self.drafter.draft_logits(guesses)  # (R, V')
        if self.params.greedy:
            return logits.softmax(-1)
        return logits_to_probs(logits, self.params)

    def children(self, parents: list[int], q: Tensor, k: int) -> list[list[int]]:
        """Add up to k candidates under each parent (rows of q (R, V')); their node indices."""
        values, top = q.topk(k, dim=-1)  # (R, k) each, descending
        if self.params.greedy:
            tokens = top
        else:
            u = torch.rand(q.shape, generator=self.generator, device=q.device).clamp_(1e-20, 1.0)
            gumbel = q.log() - (-u.log()).log()  # (R, V); -inf outside q's support
            tokens = gumbel.topk(k, dim=-1).indices  # (R, k): k draws without replacement, in order
        # Read back once: on a GPU each element read is a wait for the device.
        logv = values.clamp(min=0).log().tolist()
        ids = (tokens if self.drafter.vocab is None else self.drafter.vocab[tokens]).tolist()  # (R, k) ids
        out: list[list[int]] = []
        for row, parent in enumerate(parents):
            base = 0.0 if parent < 0 else self.nodes[parent].score
            depth = 1 if parent < 0 else self.nodes[parent].depth + 1
            made: list[int] = []
            remaining = None if self.params.greedy else q[row].clone()
            for r in range(k):
                if logv[row][r] == float("-inf"):
                    break  # fewer than k tokens have mass
                cond = None
                if remaining is not None:
                    cond = remaining / remaining.sum()
                    remaining[tokens[row, r]] = 0.0
                self.nodes.append(_Node(ids[row][r], parent, depth, r, base + logv[row][r], cond))
                made.append(len(self.nodes) - 1)
            out.append(made)
        return out

    def expand(self, nodes: list[int]) -> Tensor:
        """Run the head on `nodes` (all of one depth) over the cache and their ancestors' pairs;
        returns their draft distributions (R, V)."""
        cache = self.drafter.cache
        start = cache.length
        for i, node in enumerate(nodes):
            self.nodes[node].slot = start + i
        device = cache.k.device
        # Laid out on the host and copied once (on a GPU each element set is a launch).
        mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)
        mask[:, : self.committed] = True
        for i, node in enumerate(nodes):
            walk = node
            while walk >= 0:
                slot = self.nodes[walk].slot
                if slot is not None:
                    mask[i, slot] = True
                walk = self.nodes[walk].parent
        mask = mask.to(device)
        tokens = torch.tensor([self.nodes[n].token for n in nodes], device=device)
        feats = torch.stack([self.guess[self.nodes[n].parent] for n in nodes])  # (R, C)
        depth = self.nodes[nodes[0]].depth
        positions = torch.full((len(nodes),), self.committed + depth - 1, device=device)
        out = self.head.run(cache, self.drafter.embed(tokens), feats, positions, mask)  # (R, C)
        for i, node in enumerate(nodes):
            self.guess[node] = out[i]
        return self.distributions(out)

    def tree(self, keep: list[int]) -> DraftTree:
        """The kept nodes (a prefix-closed set) as a DraftTree, by depth, siblings in rank order."""
        order = sorted(keep, key=lambda i: (self.nodes[i].depth, i))
        index = {node: k + 1 for k, node in enumerate(order)}
        device = self.drafter.cache.k.device
        tokens = torch.tensor([self.nodes[i].token for i in order], dtype=torch.long, device=device)
        parents = torch.tensor(
            [index[self.nodes[i].parent] if self.nodes[i].parent >= 0 else 0 for i in order],
            dtype=torch.long,
            device=device,
        )
        probs = None
        if not self.params.greedy and order:
            q = torch.stack([self.nodes[i].q for i in order]).float()  # type: ignore[misc]  # (N, V')
            if self.drafter.vocab is None:
                probs = q
            else:  # over the target's vocabulary: zero outside the draft vocabulary
                probs = q.new_zeros(len(order), self.head.vocab_size)
                probs[:, self.drafter.vocab] = q
        return DraftTree(tokens, parents, probs)


class EagleDrafter(Drafter):
    """Drafts a tree with an EAGLE head; made per request.

    `EagleDrafter.static(head, target, choices)`: EAGLE-1 with `eagle_choices` (None: the
    head's fitted tree, else `default_choices`). `EagleDrafter.dynamic(head, target, depth,
    top_k, total_tokens)`: EAGLE-2.

    Lossless: greedy requests draft top-k tokens and the greedy verifier decides. Sampled
    requests draw candidates from the draft distribution processed like the target's, without
    replacement, and declare each node's conditional distribution (`DraftTree.draft_probs`), so
    `verify_sampling`'s multi-round speculative sampling keeps the target distribution. That
    needs each sibling's token distributed as declared given everything decided before it is
    tried; which nodes exist may depend on ancestors and earlier siblings but never on the node's
    own token: node scores come from sorted q values, not from the drawn tokens (`_Growth`).
    """

    def __init__(
        self,
        head: EagleHead,
        target: Transformer,
        choices: Sequence[Sequence[int]] | None = None,
        grow: tuple[int, int, int] | None = None,
    ) -> None:
        check_fits(head, target)
        self.head, self.target = head, target
        self.embed = target.embed
        self.vocab = None if head.draft_vocab is None else head.draft_vocab.to(target.device)  # (V',)
        self.grow = grow  # EAGLE-2's (depth, top_k, total_tokens); None: the static tree
        self.paths: tuple[tuple[int, ...], ...] = ()
        if grow is None:
            if choices is None:
                choices = head.choices if head.choices is not None else default_choices()
            check_choices(choices, head.vocab_size)
            self.paths = from_choices(choices).choices
            self.max_nodes = max(len(self.paths), 1)
            self.tree_slots = len(self.paths)  # pairs a step's tree may add to the head cache
        else:
            if min(grow) < 1:
                raise SpecDecodeError(f"eagle2: depth, top_k and total_tokens must be >= 1, got {grow}")
            self.max_nodes = grow[2]
            self.tree_slots = grow[1] * (grow[0] - 1)
        self.cache: KVCache = head.new_cache(1, target.dtype, target.device)
        self.last: Tensor | None = None  # (C,) head output at the last decided pair: guesses f_n
        # Decided pairs observed but not yet run through the head: run when it next drafts, all
        # in one forward (a step the load policy gives no budget then costs the head nothing).
        self.pending: list[tuple[list[int], Tensor]] = []

    @classmethod
    def static(
        cls, head: EagleHead, target: Transformer, choices: Sequence[Sequence[int]] | None = None
    ) -> EagleDrafter:
        return cls(head, target, choices)

    @classmethod
    def dynamic(
        cls,
        head: EagleHead,
        target: Transformer,
        depth: int = DEFAULT_EAGLE2[0],
        top_k: int = DEFAULT_EAGLE2[1],
        total_tokens: int = DEFAULT_EAGLE2[2],
    ) -> EagleDrafter:
        return cls(head, target, grow=(depth, top_k, total_tokens))

    def draft_logits(self, guesses: Tensor) -> Tensor:
        """(R, C) -> (R, V') float32 logits of the target's LM head over the draft vocabulary
        (`EagleHead.draft_head`); what is declared to the verifier comes from these very logits."""
        return self.head.draft_head(self.target)(guesses)

    # ---- the decided pairs: the head cache and `pending` hold exactly these between steps ------

    def _commit(self, tokens: list[int], features: Tensor) -> None:
        """Append the pairs (tokens[i], features[i]) (features (T, C)); keep the last output."""
        device = self.target.device
        ids = torch.tensor(tokens, device=device)
        start = self.cache.length
        for s in range(0, len(tokens), 512):  # bounded attention scores for long prompts
            e = min(s + 512, len(tokens))
            positions = torch.arange(start + s, start + e, device=device)
            out = self.head.run(self.cache, self.embed(ids[s:e]), features[s:e], positions)  # (T, C)
            self.last = out[-1]

    def begin(self, req: Request, prompt_hidden: Tensor) -> None:
        """Pairs (x_{t+1}, f_t) of the prompt: `prompt_hidden` (P-1, C) holds positions 0 .. P-2."""
        size = req.max_len + self.tree_slots
        self.cache = self.head.new_cache(size, self.target.dtype, self.target.device)
        self.last, self.pending = None, []
        if prompt_hidden.shape[0] > 0:
            self._commit(req.prompt_ids[1:], prompt_hidden)

    def observe(self, req: Request, result: StepResult) -> None:
        """Append (a_1, f_n), ..., (a_m, f_{n+m-1}), (bonus, f_{n+m}): the target's features of
        the root and the accepted path, with the tokens that followed each."""
        rows = [0, *result.verdict.accepted_nodes]
        self.pending.append((result.verdict.tokens, result.hidden[rows].clone()))

    def _catch_up(self) -> None:
        """Run the pending pairs through the head (see `pending`)."""
        if self.pending:
            tokens = [t for ts, _ in self.pending for t in ts]
            features = torch.cat([f for _, f in self.pending])  # (n, C)
            self.pending = []
            self._commit(tokens, features)

    # ---- drafting ------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        if (opening := opening_proposal(req, self.last is not None or bool(self.pending))) is not None:
            return opening
        self._catch_up()
        room = req.max_len - len(req.all_ids)  # draft nodes the request's cache still holds
        if budget is not None:  # no deeper than the budget: one head forward per depth
            room = min(room, budget)
        decided = self.cache.length
        growth = _Growth(self, req)
        try:
            if self.chains(budget):
                keep = self._grow_chain(growth, min(room, self.max_chain))
            elif self.grow is None:
                keep = self._grow_static(growth, room)
            else:
                keep = self._grow_dynamic(growth, room)
        finally:
            self.cache.truncate(decided)  # the tree's pairs are guesses: forget them
        keep = sorted(keep, key=lambda i: (growth.nodes[i].depth, i))[:room]  # a prefix is a tree
        return Proposal(growth.tree(keep))

    @property
    def max_chain(self) -> int:
        """The tree's depth: a budgeted step drafts a chain at most this deep (`_grow_chain`)."""
        return self.grow[0] if self.grow is not None else max((len(p) for p in self.paths), default=1)

    def _grow_chain(self, growth: _Growth, depth: int) -> list[int]:
        """The best chain of `depth` tokens (a budget below the whole tree): the top candidate of
        each depth (for sampled requests one draw), one head forward a depth past the first."""
        frontier = growth.children([-1], growth.root_distribution()[None], 1)[0]
        for _ in range(depth - 1):
            if not frontier:
                break
            frontier = growth.children(frontier, growth.expand(frontier), 1)[0]
        return list(range(len(growth.nodes)))

    def _grow_static(self, growth: _Growth, room: int) -> list[int]:
        """EAGLE-1: the declared paths level by level, one head forward per depth over the nodes
        that have children. A path whose rank its (sampled) parent cannot fill is dropped, and
        so is one deeper than the request has room for."""
        paths = {p for p in self.paths if len(p) <= room}
        width: dict[tuple[int, ...], int] = {}  # parent path -> candidates it needs
        for path in paths:
            width[path[:-1]] = max(width.get(path[:-1], 0), path[-1] + 1)
        found: dict[tuple[int, ...], int] = {(): -1}
        frontier: dict[tuple[int, ...], Tensor] = {(): growth.root_distribution()}  # path -> (V,)
        while frontier:
            parents = list(frontier)
            made = growth.children(
                [found[p] for p in parents],
                torch.stack(list(frontier.values())),
                max(width[p] for p in parents),
            )
            grown: list[tuple[int, ...]] = []
            for parent, nodes in zip(parents, made, strict=True):
                for node in nodes:
                    path = (*parent, growth.nodes[node].rank)
                    if path in paths:
                        found[path] = node
                        if path in width:
                            grown.append(path)
            rows = growth.expand([found[p] for p in grown]) if grown else None  # (R, V)
            frontier = {p: rows[i] for i, p in enumerate(grown)} if rows is not None else {}
        return [node for path, node in found.items() if path]

    def _grow_dynamic(self, growth: _Growth, room: int) -> list[int]:
        """EAGLE-2: expand the top_k nodes of each depth by cumulative score (top_k candidates
        each), then keep the total_tokens best nodes overall. A node scores at most its parent
        and ties rank the shallower first, so the kept set holds every kept node's ancestors."""
        assert self.grow is not None
        depth, top_k, total = self.grow
        depth = min(depth, room)
        nodes = growth.nodes
        frontier = growth.children([-1], growth.root_distribution()[None], top_k)[0]
        for _ in range(depth - 1):
            best = sorted(frontier, key=lambda i: (-nodes[i].score, i))[:top_k]
            if not best:
                break
            made = growth.children(best, growth.expand(best), top_k)
            frontier = [i for group in made for i in group]
        ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
        return ranked[:total]
