"""Draft-model speculation: a smaller model with the target's vocabulary drafts a chain of tokens.

The draft keeps its own KV cache for the whole request, so each step it only runs the tokens it
has not seen (the tokens the target emitted last step, at least the root) and then K single-token
forwards; it never re-reads the prompt. After verification its cache is cut back to the longest
prefix that still agrees with the request, which is bookkeeping only. The cache is a static
`KVCache` by default; the serving engine passes a factory of paged caches over a shared block pool
(`DraftCacheFactory`). When such a pool runs out of blocks, the step drafts nothing (a plain step,
still exact) and the draft gives its blocks back, to start over at the next step. With the
engine's prefix caching, the draft's full blocks of verified tokens are offered to later requests
as the target's are: a conversation's next turn prefills only its new tokens in the draft too (on
Qwen2.5-Coder's coding turns the draft's prefill of a second turn took ~0.35 s of its first token's
~0.6-0.9 s).

Losslessness does not depend on the draft at all, only on telling the verifier the truth about
where each draft token came from: under sampling a token is drawn from the draft's processed
distribution q, which is either attached (`use_draft_logits`, rejection sampling against q) or
withheld (the verifier then treats the token as a point mass, which is also exact, only with a
lower acceptance rate). Greedy drafting is argmax, verified by token matching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from specdecode.attention import PREFILL_KERNEL_ROWS
from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.errors import OutOfKVBlocks, SpecDecodeError
from specdecode.kv_cache import SequenceCache
from specdecode.layers.lm_head import DraftHead
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.sampling import argmax_rows, logits_to_probs, sample
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.request import Request

FEED_CHUNK = 512  # tokens per draft forward when catching up: bounds the attention scores' memory
# Tokens per draft forward over a prompt: the target's prefill chunks, which take the row attention
# and the one-call decoder within a prompt's first positions (`attention.row_kernel_takes`). The
# Qwen 0.5B (drafting for the 1.5B, int8 prompt rows, AVX-512) prefilled 300 / 520 / 1000 tokens
# in 535 / 970 / 2010 ms so, against 557 / 1026 / 2108 in chunks of 64.
PROMPT_CHUNK = PREFILL_KERNEL_ROWS

# (draft model, max_len) -> an empty cache for one request's draft, of at most max_len tokens.
DraftCacheFactory = Callable[[Transformer, int], SequenceCache]


def static_cache(draft: Transformer, max_len: int) -> SequenceCache:
    """The default `DraftCacheFactory`: a static `KVCache` per request."""
    return draft.new_cache(max_len)


class DraftSettings(Protocol):
    """What the drafter reads from its config: `DraftModelConfig` or `PromptLookupConfig`."""

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def use_draft_logits(self) -> bool: ...

    @property
    def draft_window(self) -> int | None: ...


class DraftModelDrafter(Drafter):
    """Drafts `num_draft_tokens` tokens a step with `draft`, a chain verified by the target.

    `target_vocab_size` is the target's embedding size V: draft_probs rows are (V,). When the
    draft's embedding size Vd differs (models of one family are padded differently), the draft
    only ever proposes ids below min(Vd, V), and any id >= Vd in the request (target padding ids,
    which a trained target never emits) is fed to the draft as id 0: the draft's guesses suffer,
    correctness does not.

    Made per request; the engine calls `begin` after its prefill (here: the draft's own prefill
    of the prompt minus its last token); `propose` also starts it lazily if `begin` was skipped
    or the cache was released. Assumes `req.all_ids` only grows by appending (the engine's
    contract). `new_cache` makes the draft's cache (see `DraftCacheFactory`). `head`: the
    draft's LM head over its first Vh ids (`draft_vocab_size`, shared by the requests; None: the
    whole head), the only tokens it then proposes.
    """

    def __init__(
        self,
        config: DraftSettings,
        draft: Transformer,
        target_vocab_size: int,
        new_cache: DraftCacheFactory = static_cache,
        head: DraftHead | None = None,
    ) -> None:
        self.num_draft_tokens = config.num_draft_tokens
        self.use_draft_logits = config.use_draft_logits
        self.window = config.draft_window
        self.draft = draft
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = draft.config.vocab_size
        self.shared_vocab = min(self.draft_vocab_size, target_vocab_size)
        self.head = head
        self.max_nodes = self.num_draft_tokens
        self.new_cache = new_cache
        self.cache: SequenceCache | None = None
        # Token of every slot in the draft's cache (len == cache.length): the request's tokens
        # followed by the draft tokens fed last step.
        self._fed: list[int] = []
        # Length of a prefix of `_fed` known to equal the request's: it stays true as both only
        # grow or are cut back to such a prefix, so agreement is checked only past it.
        self._agreed = 0
        # Where in the request's tokens the draft's context starts (`draft_window`): `_fed`,
        # `_agreed` and the cache count from there.
        self._start = 0

    # ---- Drafter interface ---------------------------------------------------------------------

    @torch.inference_mode()
    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        """Make the draft's cache (as large as the request's) and prefill the prompt without its
        last token, the first root. `prompt_hidden` (the target's) is not used."""
        self.release()
        self.cache = self.new_cache(self.draft, req.max_len)
        if self.window is not None:
            self._start = max(0, len(req.prompt_ids) - 1 - self.window)
        prefix = req.prompt_ids[self._start : -1]
        if len(prefix) < self.cache.max_len:  # else the prompt exceeds the draft's context
            try:
                # A prompt that starts like an earlier request's (a conversation's next turn, a
                # shared system prompt) reuses the draft's blocks of it, as the target's do.
                self._fed = list(prefix[: self.cache.reuse_prefix(prefix)])
                self._feed(prefix[len(self._fed) :], prompt=True)
                self.cache.register_full_blocks(self._fed)
            except OutOfKVBlocks:  # propose starts over
                self.release()

    @torch.inference_mode()
    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        try:
            return self._propose(req, budget)
        except OutOfKVBlocks:  # draft nothing this step; give the blocks back for others
            self.release()
            return Proposal(DraftTree.empty())

    def release(self) -> None:
        """Free the draft's cache (its blocks, when paged) and forget what it held."""
        if self.cache is not None:
            self.cache.release()
        self.cache = None
        self._fed, self._agreed, self._start = [], 0, 0

    def _propose(self, req: Request, budget: int | None) -> Proposal:
        if self.cache is None:
            self.begin(req, None)
        if self.cache is None:  # begin ran out of blocks
            return Proposal(DraftTree.empty())
        ids = req.all_ids[self._start :]  # the draft's context
        length = len(ids)
        # Target: the root and K draft tokens need `len(all_ids) + K` slots of req.max_len. Draft:
        # it feeds its context and K-1 draft tokens, `length + K - 1` slots of its own cache.
        k = min(self.num_draft_tokens, req.max_len - len(req.all_ids), self.cache.max_len - length + 1)
        if budget is not None:  # one draft forward a token: none past the budget
            k = min(k, budget)
        if k <= 0:
            return Proposal(DraftTree.empty())
        self._sync(ids)
        if len(self._fed) >= length:  # root already cached (propose twice): re-run it for its logits
            self._truncate(length - 1)
        hidden = self._feed(ids[len(self._fed) :])  # (C,) of the root
        self._agreed = length
        greedy = req.params.greedy
        tokens: list[int] = []
        rows: list[torch.Tensor] = []  # (Vs,) each: what each token was drawn from
        for i in range(k):
            logits = self._logits(hidden)  # (Vs,)
            if greedy:
                token = argmax_rows(logits[None])[0]
            else:
                q = logits_to_probs(logits, req.params)  # (Vs,)
                token = self._draw(q, req.generator)
                rows.append(q)
            tokens.append(token)
            if i + 1 < k:  # the last draft token is never fed: nothing would read its output
                hidden = self._feed([token])
        probs = None
        if rows and self.use_draft_logits:
            probs = torch.zeros(k, self.target_vocab_size, dtype=rows[0].dtype, device=rows[0].device)
            probs[:, : rows[0].shape[0]] = torch.stack(rows)  # (K, V), zero past the ids drafted from
        return Proposal(DraftTree.chain(torch.tensor(tokens, device=self.draft.device), probs))

    def observe(self, req: Request, result: StepResult) -> None:
        """Forget the rejected draft tokens: cut the cache to the prefix agreeing with the request,
        and offer its full blocks of the request's tokens for later requests to reuse (not the
        root's: `_propose` may cut the cache back to before it)."""
        if self.cache is not None:
            ids = req.all_ids[self._start :]
            self._sync(ids)
            self.cache.register_full_blocks(self._fed[: len(ids) - 1])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(C,) -> (Vs,) float32: the logits of the ids the draft proposes from."""
        if self.head is None:
            return self.draft.logits(hidden)[: self.shared_vocab]
        return self.head(hidden[None])[0, : self.shared_vocab]

    # ---- cache bookkeeping ---------------------------------------------------------------------

    def _sync(self, ids: list[int]) -> None:
        """Cut the draft's cache to the longest common prefix of its tokens and `ids`."""
        fed = self._fed
        n = min(len(fed), len(ids))
        i = min(self._agreed, n)
        while i < n and fed[i] == ids[i]:
            i += 1
        self._truncate(i)

    def _truncate(self, length: int) -> None:
        assert self.cache is not None
        self.cache.truncate(length)
        del self._fed[length:]
        self._agreed = min(self._agreed, length)

    def _feed(self, tokens: list[int], prompt: bool = False) -> torch.Tensor:
        """Run `tokens` through the draft after its cache (chunked); returns the last hidden state
        (C,), or an empty (0,) tensor when `tokens` is empty (begin with a one-token prompt).
        `prompt`: they are the prompt's, which the draft's kernels read with the prompt rows'
        arithmetic (`Kernels.int8_activations`: int8); else they take its decoding rows'."""
        assert self.cache is not None
        device = self.draft.device
        hidden = torch.empty(0, device=device)
        inputs = tokens
        if self.target_vocab_size > self.draft_vocab_size:  # ids the draft cannot embed -> 0
            inputs = [t if t < self.draft_vocab_size else 0 for t in tokens]
        size = PROMPT_CHUNK if prompt else FEED_CHUNK
        for s in range(0, len(inputs), size):
            chunk = torch.tensor([inputs[s : s + size]], device=device)  # (1, T)
            start = self.cache.length
            positions = torch.arange(start, start + chunk.shape[1], device=device)[None]  # (1, T)
            hidden = self.draft(chunk, positions, self.cache, prompt=prompt)[0, -1]  # (C,)
        self._fed.extend(tokens)
        return hidden

    @staticmethod
    def _draw(q: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from q (Vs,) with the request's generator, wherever that generator lives."""
        if generator is not None and generator.device != q.device:
            q = q.to(generator.device)
        return sample(q, generator)


def check_vocabularies(
    target_tokenizer: Tokenizer,
    draft_tokenizer: Tokenizer,
    target_name: str = "target",
    draft_name: str = "draft",
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> None:
    """Raise `SpecDecodeError` naming both models unless they map tokens to ids identically.

    A draft model only helps when its token ids mean what the target's mean; a different
    tokenizer would still be lossless but would draft nonsense, which is almost certainly a
    mistake worth stopping. Only ids below the smaller embedding size (the `*_vocab_size`
    arguments, else the smaller tokenizer) are compared: past it, models of one family differ
    only by padding or by tokens the smaller model cannot produce anyway. One dictionary
    comparison, cheap even for 150k-token vocabularies.
    """
    sizes = [s for s in (target_vocab_size, draft_vocab_size) if s is not None]
    limit = min(sizes) if sizes else min(target_tokenizer.vocab_size, draft_tokenizer.vocab_size)
    target = {i: tok for tok, i in target_tokenizer.get_vocab().items() if i < limit}
    draft = {i: tok for tok, i in draft_tokenizer.get_vocab().items() if i < limit}
    differing = sorted(i for i in target.keys() | draft.keys() if target.get(i) != draft.get(i))
    if not differing:
        return
    first = differing[0]
    raise SpecDecodeError(
        f"draft model {draft_name!r} does not share the vocabulary of target model {target_name!r}: "
        f"{len(differing)} of the first {limit} token ids differ (e.g. id {first} is "
        f"{target.get(first)!r} in the target, {draft.get(first)!r} in the draft); "
        "choose a draft model from the target's family"
    )
