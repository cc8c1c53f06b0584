"""Verification: decide which draft tokens the target keeps, from one tree-attention forward pass.

Terms (defined here once, used across specdecode):

- *draft* tokens: the tokens a speculative method proposes, as the nodes of a `DraftTree`.
- *accepted* tokens: the draft tokens the verifier keeps. They always form one root-to-node path
  of the tree, and the KV cache keeps exactly the root and these nodes.
- *recovered* token: when every child of the current node is rejected, the token sampled from
  the residual distribution left after the rejections (greedy: the target's argmax, which is by
  definition none of the children). It corrects the draft.
- *bonus* token: when the walk reaches a node with no children (a fully accepted path), the
  token sampled from the target distribution at that node (greedy: its argmax). It is free: the
  forward pass already computed its distribution.
- τ (tau): tokens emitted per target forward pass, `len(Verdict.tokens)` = accepted + 1; the
  figure of merit of a speculative method is its mean τ (plain decoding has τ = 1).

Every verification step emits exactly one target token (recovered or bonus) after the accepted
ones, so it never emits fewer tokens than plain decoding.

Input rows: the target's output at forward index i (row i of `target_logits` / `target_probs`,
shape (N+1, V)) is the distribution of the token that follows node i (row 0: follows the root).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.sampling import argmax_rows
from specdecode.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft tree.

    `accepted_nodes`: accepted node indices in forward numbering, root-to-leaf order, root
    excluded. `tokens`: the tokens to append to the sequence, i.e. the accepted draft tokens
    followed by the one recovered or bonus token (`len(tokens) == len(accepted_nodes) + 1`).
    """

    accepted_nodes: list[int]
    tokens: list[int]

    @property
    def num_draft_accepted(self) -> int:
        """Number of accepted draft tokens (τ - 1 for this step)."""
        return len(self.accepted_nodes)

    @property
    def kept_indices(self) -> list[int]:
        """Forward-input indices whose KV entries survive compaction: the root and the accepted path."""
        return [0, *self.accepted_nodes]


def _check_rows(tree: DraftTree, rows: Tensor, name: str) -> None:
    n = tree.num_nodes
    if rows.dim() != 2 or rows.shape[0] != n + 1:
        raise ValueError(f"{name} must be (N+1={n + 1}, V), got {tuple(rows.shape)}")
    if tree.vocab_size is not None and tree.vocab_size != rows.shape[1]:
        raise ValueError(
            f"{name} has vocabulary size {rows.shape[1]} but the draft_probs have {tree.vocab_size}"
        )


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> Verdict:
    """Greedy verification: keep the longest path that the target's argmax agrees with.

    `target_logits` is (N+1, V) (logits or probabilities; only the argmax matters). From the
    root: let t be the argmax at the current node; if a child has token t, accept the first such
    child and continue from it; otherwise stop and emit t. The emitted tokens are exactly what
    plain greedy decoding would produce from these rows (ties resolve as `torch.argmax`, to the
    first maximal index).
    """
    _check_rows(tree, target_logits, "target_logits")
    return greedy_walk(tree, argmax_rows(target_logits))


def greedy_walk(tree: DraftTree, best: Sequence[int]) -> Verdict:
    """`verify_greedy` given `best[i]`, the target's greedy token after node i (N+1 ints), for
    callers that obtain the argmax without materialising every row's logits."""
    children = tree.children()
    draft = tree.token_ids
    accepted: list[int] = []
    node = 0
    while True:
        want = best[node]
        match = next((c for c in children[node] if draft[c - 1] == want), None)
        if match is None:
            return Verdict(accepted, [draft[c - 1] for c in accepted] + [want])
        accepted.append(match)
        node = match


def _residual(p: Tensor, token: int, q: Tensor | None) -> Tensor:
    """normalize(max(0, p - q)) after rejecting `token` drawn from q (None: point mass). (V,) -> (V,)

    Fallback when the residual has no mass: return p unchanged. This cannot happen in exact
    arithmetic. A rejection needs p(x) < q(x) for the drawn x (we accept with probability
    min(1, p(x)/q(x)), so p(x) >= q(x) means certain acceptance). If max(0, p - q) were all zero,
    then p <= q everywhere, and since both sum to 1, p = q, so p(x) = q(x): contradiction. For
    a point mass q(x) = 1, a rejection needs p(x) < 1, so p has mass elsewhere. Only rounding
    (p(x) a hair below q(x) with p = q otherwise) or a q that is not the distribution the token
    was drawn from can empty it; then p itself is the least-wrong distribution to sample.
    """
    if q is None:
        r = p.clone()  # (V,)
        r[token] = 0.0
    else:
        r = (p - q).clamp_(min=0.0)  # (V,)
    total = float(r.sum())
    if not total > 0.0:  # also catches NaN
        return p
    return r / total


def verify_sampling(
    tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Lossless speculative sampling over a tree: the emitted tokens are distributed exactly as
    if sampled one by one from the target.

    `target_probs` is (N+1, V), the target's probabilities after the same temperature/top-k/top-p
    processing that plain sampling would apply. `generator` (on `target_probs`' device, or None
    for torch's default) drives every random draw.

    Walk from the root with p = target_probs[node]. Try the node's children in increasing index.
    For child c with token x drawn from q (`tree.draft_probs[c-1]`, or the point mass on x when
    the tree has no probabilities), accept with probability min(1, p(x)/q(x)); if accepted, move
    to c with the fresh p = target_probs[c]. If rejected, set p <- normalize(max(0, p - q)) and
    try the next sibling (for a point mass this zeroes p(x) and renormalizes, so a duplicate
    sibling with the same token is then rejected for sure). If every child is rejected, sample
    the recovered token from the final residual p and stop. At a node with no children, sample
    the bonus token from target_probs[node] and stop.

    Why this is lossless with several siblings: it is the multi-step speculative sampling of
    SpecInfer (Miao et al., ASPLOS 2024, "SpecInfer: Accelerating LLM Serving with Tree-based
    Speculative Inference and Verification", Sec. 4 and its Theorem 4.2), used for EAGLE's trees
    as "multi-round speculative sampling" (Li et al., ICML 2024, "EAGLE: Speculative Sampling
    Requires Rethinking Feature Uncertainty", appendix). Each try is one step of ordinary
    speculative sampling (Leviathan et al. 2023; Chen et al. 2023), whose output, accepted token
    or a sample from the residual, is distributed as the current p. By induction over the
    siblings, the node's emitted token is distributed as the target row. The induction needs
    sibling k's token to be distributed as its q given everything before, i.e. draft_probs[c-1]
    must be the distribution c's token was actually drawn from, given its context and its
    earlier siblings: for siblings drawn independently from the same q (SpecInfer, EAGLE) that
    is q for each of them; for deterministic picks (top-k, lookup) it is the point mass (None).
    """
    _check_rows(tree, target_probs, "target_probs")
    n = tree.num_nodes
    vocab = target_probs.shape[1]
    device = target_probs.device
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    children = tree.children()
    draft = tree.token_ids
    if any(x >= vocab for x in draft):
        raise ValueError(f"a draft token id is >= the target vocabulary size {vocab}")
    probs = target_probs.to(dtype)  # (N+1, V)
    q_rows = None if tree.draft_probs is None else tree.draft_probs.to(device=device, dtype=dtype)  # (N, V)

    # One host sync for everything the common case needs: a uniform per node, p(x) under the
    # parent's (un-modified) target row, and q(x).
    tokens_d = tree.tokens.to(device)  # (N,)
    parents_d = tree.parents.to(device)  # (N,)
    uniforms = torch.rand(n, generator=generator, device=device, dtype=dtype)  # (N,)
    p_first = probs[parents_d, tokens_d]  # (N,)
    q_at = (
        torch.ones(n, device=device, dtype=dtype)
        if q_rows is None
        else q_rows[torch.arange(n, device=device), tokens_d]
    )  # (N,)
    u_list, p_list, q_list = torch.stack([uniforms, p_first, q_at]).tolist() if n else ([], [], [])

    accepted: list[int] = []
    node = 0
    while True:
        p = probs[node]  # (V,) current (residual) target distribution at `node`
        fresh = True  # p is still the unmodified target row
        chosen = None
        for child in children[node]:
            x = draft[child - 1]
            px = p_list[child - 1] if fresh else float(p[x])
            # Accept with probability min(1, px / qx); written without division so qx = 0 (a
            # token outside q's support) accepts whenever px > 0.
            if u_list[child - 1] * q_list[child - 1] < px:
                chosen = child
                break
            p = _residual(p, x, None if q_rows is None else q_rows[child - 1])
            fresh = False
        if chosen is None:
            # Recovered token (some child rejected) or bonus token (no child): sample from p.
            last = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(accepted, [draft[c - 1] for c in accepted] + [last])
        accepted.append(chosen)
        node = chosen


def verify_typical(
    tree: DraftTree,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> Verdict:
    """Medusa's *typical acceptance*: LOSSY, an explicit opt-in, never a default.

    Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
    Heads", Sec. 2.3.1. A draft token x following forward index i is *typical* when
    `p_i(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_i)))`, with p_i =
    `target_probs[i]` (already temperature/top-k/top-p processed) and H its entropy. The verdict
    accepts the deepest path of typical tokens (ties: the path of largest prod p_i(x), then the
    smallest node index), then samples one token from the target row where the path ends.

    Why it is lossy: a typical token is accepted with probability 1 however likely the target
    makes it, and a recovered token is drawn from the full row rather than the residual. With
    p = (0.6, 0.4) and a draft of the second token, this emits it every time instead of 40% of
    the time. Emitted text stays plausible (every token clears the threshold) and steps accept
    more, which is the trade Medusa makes for speed; `verify_sampling` is the exact one.
    Greedy decoding never uses this (`verify_greedy` is exact and already accepts the most).
    """
    _check_rows(tree, target_probs, "target_probs")
    n = tree.num_nodes
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    probs = target_probs.to(dtype)  # (N+1, V)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # (N+1,)
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # (N+1,)
    parents_d = tree.parents.to(probs.device)  # (N,)
    p_draft = probs[parents_d, tree.tokens.to(probs.device)]  # (N,) p of each node's token
    typical = (p_draft > threshold[parents_d]).tolist()
    log_p = torch.log(p_draft).tolist()
    parents = [0, *tree.parent_ids]
    # Nodes come in topological order, so one pass gives each node's path length and likelihood.
    ok = [True] + [False] * n
    depth = [0] * (n + 1)
    score = [0.0] * (n + 1)
    best = 0
    for node in range(1, n + 1):
        parent = parents[node]
        ok[node] = ok[parent] and typical[node - 1]
        if not ok[node]:
            continue
        depth[node] = depth[parent] + 1
        score[node] = score[parent] + log_p[node - 1]
        if (depth[node], score[node]) > (depth[best], score[best]):
            best = node
    path: list[int] = []
    node = best
    while node != 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    draft = tree.token_ids
    last = int(torch.multinomial(probs[best], 1, generator=generator))
    return Verdict(path, [draft[c - 1] for c in path] + [last])
