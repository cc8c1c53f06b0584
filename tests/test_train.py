"""The drafter training pipeline on a tiny model: ShareGPT parsing (a cut-off file included),
chat-templated samples with assistant masks, batched features equal to one-sequence forwards,
self-distillation equal to plain greedy decoding, the feature cache, Medusa labels, a resumed
run ending bit-identical to an uninterrupted one, and the `specdecode train medusa` command.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from specdecode.cli import main
from specdecode.drafters.medusa import MedusaHeads, load_heads
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
from specdecode.train import features as features_module
from specdecode.train.data import Sample, prompt, read_sharegpt, render, split
from specdecode.train.features import Features, extract, run_batch
from specdecode.train.medusa import IGNORE, Positions, TrainSettings, objective, positions, rank_counts
from specdecode.train.pipeline import MAX_RANK, Common, Objective, train_loop
from tests.alone import alone
from tests.tiny import load_tiny_hf, randomized

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "big", "red", "and", "or", "why", "is", "it"]


pytestmark = pytest.mark.usefixtures("one_thread")


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_sharegpt(path: Path, count: int, seed: int = 0, cut: bool = True) -> list[dict]:
    """`count` well-formed records plus some odd ones, as a JSON array cut inside the last record."""
    rng = random.Random(seed)
    records: list[dict] = []
    for i in range(count):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": sentence(rng, rng.randint(2, 6)) + "?"})
            turns.append({"from": "gpt", "value": sentence(rng, rng.randint(3, 12)) + "."})
        records.append({"id": f"r{i}", "conversations": turns})
    records.append({"id": "empty", "conversations": []})
    records.append({"id": "continued", "conversations": [{"from": "gpt", "value": "more."}]})
    records.append({"id": "last", "conversations": [{"from": "human", "value": "this one is cut"}]})
    text = json.dumps(records, indent=1)
    if cut:
        text = text[: text.rindex("this one is cut") + 4]  # mid-way through the last record
    path.write_text(text)
    return records


@pytest.fixture(scope="module")
def tiny(tiny_chat_dir: Path) -> tuple[Transformer, Tokenizer]:
    return Transformer.from_dir(tiny_chat_dir), Tokenizer.from_dir(tiny_chat_dir)


# ------------------------------------------------------------------------------------------------
# Data


def test_read_sharegpt_keeps_every_record_before_the_cut(tmp_path: Path) -> None:
    records = write_sharegpt(tmp_path / "data.json", 12)
    conversations = read_sharegpt(tmp_path / "data.json")
    assert len(conversations) == 12  # the empty, the assistant-only and the cut record are gone
    first = records[0]["conversations"]
    assert [m["role"] for m in conversations[0]] == ["user", "assistant"] * (len(first) // 2)
    assert conversations[0][0]["content"] == first[0]["value"]
    assert len(read_sharegpt(tmp_path / "data.json", max_conversations=5)) == 5


def test_read_sharegpt_orders_roles(tmp_path: Path) -> None:
    """Leading answers (a split conversation's later part) are dropped; disorder ends a record."""
    records = [
        {"conversations": [{"from": "gpt", "value": "A."}, {"from": "human", "value": "Q?"}]},
        {"conversations": [{"from": "human", "value": "Q?"}, {"from": "human", "value": "again?"}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q?"}]},
        {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "  "}]},
        {"conversations": [{"from": "robot", "value": "beep"}]},
    ]
    (tmp_path / "d.json").write_text("\n".join(json.dumps(r) for r in records))  # JSON lines work too
    got = read_sharegpt(tmp_path / "d.json")
    assert got == [
        [{"role": "user", "content": "Q?"}],
        [{"role": "user", "content": "Q?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}],
        [{"role": "user", "content": "Q?"}],
    ]
    (tmp_path / "none.json").write_text("[]")
    with pytest.raises(SpecDecodeError, match="no ShareGPT conversations"):
        read_sharegpt(tmp_path / "none.json")
    with pytest.raises(SpecDecodeError, match="not found"):
        read_sharegpt(tmp_path / "missing.json")


TWO_TURNS = [
    {"role": "user", "content": "hi?"},
    {"role": "assistant", "content": "yo."},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": "ah"},
]


def test_render_masks_what_the_assistant_wrote(tiny: tuple[Transformer, Tokenizer]) -> None:
    _, tok = tiny
    conversation = TWO_TURNS
    sample = render(tok, conversation, max_len=1000)
    assert sample is not None
    assert sample.ids == tok.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True)
    written = [
        tok.decode([t], skip_special_tokens=False) for t, m in zip(sample.ids, sample.mask, strict=True) if m
    ]
    assert "".join(written) == "yo.<|im_end|>ah<|im_end|>"  # answers and their end tokens, no "\n"
    assert sample.prompt_len == sample.mask.index(True)
    cut = render(tok, conversation, max_len=sample.prompt_len + 2)
    assert cut is not None and cut.ids == sample.ids[: sample.prompt_len + 2] and sum(cut.mask) == 2
    assert render(tok, conversation, max_len=sample.prompt_len) is None  # no answer token fits


def test_prompt_is_the_first_turn_ready_for_the_reply(tiny: tuple[Transformer, Tokenizer]) -> None:
    _, tok = tiny
    conversation = [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "yo."}]
    sample = prompt(tok, conversation, max_len=100)
    assert sample is not None and not any(sample.mask)
    assert (
        tok.decode(sample.ids, skip_special_tokens=False)
        == "<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt(tok, conversation, max_len=len(sample.ids) - 1) is None


def test_prompt_turn_two_keeps_the_first_exchange_as_context(tiny: tuple[Transformer, Tokenizer]) -> None:
    _, tok = tiny
    conversation = TWO_TURNS
    sample = prompt(tok, conversation, max_len=100, turn=2)
    assert sample is not None and not any(sample.mask) and sample.prompt_len == len(sample.ids)
    assert tok.decode(sample.ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\nyo.<|im_end|>\n"
        "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt(tok, conversation[:2], max_len=100, turn=2) is None  # one question only
    assert prompt(tok, conversation, max_len=len(sample.ids) - 1, turn=2) is None


def test_split_is_seeded_and_sized() -> None:
    items = list(range(50))
    train, held = split(items, 0.1, seed=3)
    assert len(held) == 5 and sorted(train + held) == items
    assert split(items, 0.1, seed=3) == (train, held)
    assert len(split(items, 7, seed=0)[1]) == 7
    assert split([1], 0.5, seed=0) == ([1], [])


# ------------------------------------------------------------------------------------------------
# Features


def random_samples(count: int, seed: int, low: int = 3, high: int = 20) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [rng.randrange(3, 96) for _ in range(rng.randint(low, high))]
        out.append(Sample(ids, [False] * len(ids), len(ids)))
    return out


def own_continuations(
    out: Path, prompts: list[list[int]], new_tokens: int = 81
) -> tuple[Transformer, Features]:
    """A tiny Llama target (seed 3, written under `out`) and its features over its own greedy
    continuations of `prompts`, up to `new_tokens` each: data from which a drafter learns exactly
    the rows that decoding these prompts will show it."""
    model = load_tiny_hf(out / "model", seed=3)
    samples = [Sample(p, [False] * len(p), len(p)) for p in prompts]
    max_len = max(len(p) for p in prompts) + new_tokens
    feats = extract(
        model, samples, generate=True, max_len=max_len, eos_ids=[], cache_dir=out / "f", model_tag="t",
        progress=False,
    )  # fmt: skip
    return model, feats


def test_batched_features_equal_one_sequence_forwards(tiny: tuple[Transformer, Tokenizer]) -> None:
    model, _ = tiny
    samples = random_samples(5, seed=1)
    for (ids, _, hidden), sample in zip(run_batch(model, samples, False, 64, [2]), samples, strict=True):
        assert ids == sample.ids
        cache = model.new_cache(len(ids))
        with torch.inference_mode():
            alone = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, :-1]  # (L-1, C)
        torch.testing.assert_close(hidden.float(), alone.half().float(), atol=2e-3, rtol=2e-3)


def test_self_distillation_is_plain_greedy_decoding(tiny: tuple[Transformer, Tokenizer]) -> None:
    """Each row continues exactly as one-request greedy decoding, stops at end-of-sequence or
    max_len, and its hidden states are those of a forward over the whole result."""
    model, _ = tiny
    samples = random_samples(6, seed=2)
    max_len = 40
    eos = [2, 7]  # a second stop id, so some rows end early
    rows = run_batch(model, samples, True, max_len, eos)
    for (ids, mask, hidden), sample in zip(rows, samples, strict=True):
        params = SamplingParams(max_tokens=max_len - len(sample.ids), temperature=0)
        req, steps = alone(model, sample.ids, params, eos)
        for _ in steps:
            pass
        assert ids == sample.ids + req.output_ids
        assert mask == [False] * len(sample.ids) + [True] * len(req.output_ids)
        assert hidden.shape == (len(ids) - 1, model.config.hidden_size)
        cache = model.new_cache(len(ids))
        with torch.inference_mode():
            whole = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0, :-1]
        torch.testing.assert_close(hidden.float(), whole.half().float(), atol=2e-3, rtol=2e-3)
    assert any(len(ids) < max_len for ids, _, _ in rows) and any(len(ids) == max_len for ids, _, _ in rows)


def test_self_distilled_answers_stop_at_max_new(tiny: tuple[Transformer, Tokenizer]) -> None:
    """With `max_new` each row writes at most that many tokens (or stops earlier at max_len or
    end-of-sequence), exactly what greedy decoding with that token budget writes."""
    model, _ = tiny
    samples = random_samples(6, seed=4, low=3, high=30)
    max_len, max_new = 40, 6
    rows = run_batch(model, samples, True, max_len, [2], max_new=max_new)
    for (ids, mask, hidden), sample in zip(rows, samples, strict=True):
        budget = min(max_new, max_len - len(sample.ids))
        req, steps = alone(model, sample.ids, SamplingParams(max_tokens=budget, temperature=0), [2])
        for _ in steps:
            pass
        assert ids == sample.ids + req.output_ids and len(req.output_ids) <= budget
        assert sum(mask) == len(req.output_ids) and hidden.shape[0] == len(ids) - 1
    assert any(sum(m) == max_new for _, m, _ in rows)  # the cap, not end-of-sequence, ended some


def test_feature_cache_resumes_at_the_missing_shard(
    tiny: tuple[Transformer, Tokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = tiny
    samples = random_samples(7, seed=3)
    calls: list[int] = []
    real = features_module.run_batch

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(features_module, "run_batch", counting)
    kwargs = dict(generate=True, max_len=30, eos_ids=[2], cache_dir=tmp_path, model_tag="t", progress=False)
    first = extract(model, samples, batch_size=3, **kwargs)  # type: ignore[arg-type]
    assert calls == [3, 3, 1] and len(first) == 7
    (tmp_path / "shard-00001.pt").unlink()
    again = extract(model, samples, batch_size=3, **kwargs)  # type: ignore[arg-type]
    assert calls == [3, 3, 1, 3]
    for a, b in zip(first.hidden + first.ids, again.hidden + again.ids, strict=True):
        assert torch.equal(a, b)
    assert first.ids[0].tolist()[: len(samples[0].ids)] == samples[0].ids  # the samples' order
    extract(model, samples[:5], batch_size=3, **kwargs)  # type: ignore[arg-type]
    assert len(calls) == 6  # other samples: the cache is replaced, not mixed


def test_one_run_trains_on_anothers_conversations(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """`--skip-conversations` takes the file's later conversations; `--more-features` appends a
    finished run's training features (in its order) to this run's, and refuses an unfinished
    cache or a directory that is not one."""
    from specdecode.train.features import load_cache
    from specdecode.train.pipeline import prepare

    data = tmp_path / "sharegpt.json"
    write_sharegpt(data, 24, cut=False)
    common = dict(data=str(data), model=str(tiny_chat_dir), max_len=256, dtype="float32", progress=False)
    first = TrainSettings(out=str(tmp_path / "a"), max_conversations=12, heldout=2, **common)  # type: ignore[arg-type]
    a = prepare(first)
    later = TrainSettings(
        out=str(tmp_path / "b"),
        max_conversations=12,
        skip_conversations=12,
        heldout=2,
        **common,  # type: ignore[arg-type]
    )
    b = prepare(later)
    assert len(a.train) == len(b.train) == 10
    texts = {tuple(t.tolist()) for t in a.train.ids} | {tuple(t.tolist()) for t in a.heldout.ids}
    assert not texts & {tuple(t.tolist()) for t in b.train.ids}  # other conversations

    joined = prepare(TrainSettings(**{**later.__dict__, "more_features": (str(tmp_path / "a/cache/train"),)}))
    assert len(joined.train) == 20 and len(joined.heldout) == len(b.heldout)
    for x, y in zip(joined.train.hidden, b.train.hidden + a.train.hidden, strict=True):
        assert torch.equal(x, y)
    loaded = load_cache(tmp_path / "a/cache/train")
    assert [t.tolist() for t in loaded.ids] == [t.tolist() for t in a.train.ids]

    (tmp_path / "a/cache/train/shard-00000.pt").unlink()
    with pytest.raises(SpecDecodeError, match="unfinished"):
        load_cache(tmp_path / "a/cache/train")
    with pytest.raises(SpecDecodeError, match="not a feature cache"):
        load_cache(tmp_path)


def test_a_run_on_long_prompts_only(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """`--min-prompt-len` keeps the conversations whose prompt is at least that long;
    `--max-answer-len` lets self-distilled prompts fill max_len minus it and caps the answers."""
    from specdecode.train.pipeline import prepare

    data = tmp_path / "sharegpt.json"
    write_sharegpt(data, 30, cut=False)
    common = dict(data=str(data), model=str(tiny_chat_dir), dtype="float32", progress=False, heldout=2)
    every = prepare(TrainSettings(out=str(tmp_path / "all"), max_len=80, self_distill=True, **common))  # type: ignore[arg-type]
    lengths = sorted(int((~m).sum()) for m in every.train.mask)
    cut = lengths[len(lengths) // 2]
    long = prepare(
        TrainSettings(
            out=str(tmp_path / "long"),
            max_len=80,
            max_answer_len=5,
            min_prompt_len=cut,
            self_distill=True,
            **common,  # type: ignore[arg-type]
        )
    )
    prompts = [int((~m).sum()) for m in long.train.mask]
    assert prompts and all(n >= cut for n in prompts) and len(prompts) < len(lengths)
    assert all(0 < int(m.sum()) <= 5 for m in long.train.mask)
    bads = (dict(max_answer_len=80), dict(max_answer_len=0), dict(min_prompt_len=-1), dict(prompt_turn=0))
    for bad in bads:
        with pytest.raises(SpecDecodeError, match=r"max_answer_len|min_prompt_len|prompt_turn"):
            prepare(TrainSettings(out=str(tmp_path / "bad"), max_len=80, self_distill=True, **common, **bad))  # type: ignore[arg-type]


def test_prompt_turn_two_answers_second_questions(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """--prompt-turn 2 self-distils the answers to second questions, the first exchange as
    context; conversations with one question are left out, and it needs --self-distill."""
    from specdecode.train.pipeline import prepare

    data = tmp_path / "sharegpt.json"
    records = write_sharegpt(data, 30, cut=False)
    common = dict(data=str(data), model=str(tiny_chat_dir), dtype="float32", progress=False, heldout=2)
    turn2 = dict(max_len=250, max_answer_len=20, self_distill=True, prompt_turn=2)
    prep = prepare(TrainSettings(out=str(tmp_path / "t2"), **turn2, **common))  # type: ignore[arg-type]
    two = sum(1 for r in records if sum(t["from"] == "human" for t in r["conversations"]) >= 2)
    assert 0 < len(prep.train) + len(prep.heldout) <= two < 30
    for ids, mask in zip(prep.train.ids, prep.train.mask, strict=True):
        context = prep.tokenizer.decode(ids[~mask].tolist(), skip_special_tokens=False)
        assert context.count("<|im_start|>user") == 2 and context.count("<|im_start|>assistant") == 2
        assert bool(mask.any())  # the target's own answer to the second question
    with pytest.raises(SpecDecodeError, match="self-distill"):
        prepare(TrainSettings(out=str(tmp_path / "raw"), max_len=250, prompt_turn=2, **common))  # type: ignore[arg-type]


def test_eval_prompts_are_prompts_in_either_kind_of_run(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """τ is measured on held-out first prompts, ready for the reply, whether the run trains on
    the dataset's answers or on the target's own, and they respect --min-prompt-len."""
    from specdecode.train.pipeline import prepare

    data = tmp_path / "sharegpt.json"
    write_sharegpt(data, 30, cut=False)
    common = dict(data=str(data), model=str(tiny_chat_dir), dtype="float32", progress=False, heldout=6)
    for distill in (False, True):
        settings = TrainSettings(out=str(tmp_path / str(distill)), max_len=80, self_distill=distill, **common)  # type: ignore[arg-type]
        prep = prepare(settings)
        found = [prompt(prep.tokenizer, c, 40) for c in prep.held_conversations]
        expected = [s.ids for s in found if s is not None][: settings.eval_prompts]
        assert expected and prep.eval_prompts(settings) == expected
        longer = TrainSettings(**{**settings.__dict__, "min_prompt_len": 10**6})
        assert prep.eval_prompts(longer) == []


# ------------------------------------------------------------------------------------------------
# Medusa training


def test_positions_label_each_head_within_the_answer() -> None:
    """ids 10..17; the assistant wrote 13..16 (17 is the next user turn). Position t trains head
    k on ids[t+2+k] when ids[t+2..t+2+k] are all assistant tokens."""
    ids = torch.arange(10, 18)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    hidden = torch.arange(7, dtype=torch.float16)[:, None].expand(7, 4)  # row t holds t
    got = positions(Features([ids], [mask], [hidden]), num_heads=3)
    assert got.hidden[:, 0].tolist() == [1, 2, 3, 4]  # t = 1..4: token t+2 is an answer token
    assert got.labels.tolist() == [
        [13, 14, 15],
        [14, 15, 16],
        [15, 16, IGNORE],
        [16, IGNORE, IGNORE],
    ]


def test_rank_counts_read_the_draft_vocabulary(tiny: tuple[Transformer, Tokenizer]) -> None:
    """With a draft vocabulary a label's rank is among its columns, as the drafter ranks them, and
    a label outside it counts as missed (rank MAX_RANK); the loss softmaxes over those columns."""
    model, _ = tiny
    c, v = model.config.hidden_size, model.config.vocab_size
    heads = randomized(lambda: MedusaHeads(1, 1, c, v), 0, 0.3)
    hidden = torch.randn(6, c).half()
    weight = model.head_weight_t().detach()
    logits = heads(hidden.float(), weight)[0]  # (6, V)
    vocab = logits[0].topk(5).indices.sort().values  # row 0's five best ids
    inside, outside = int(logits[0].argmax()), int(logits[0].argmin())
    labels = torch.tensor([[inside], [outside], [IGNORE], [inside], [inside], [inside]])
    data = Positions(hidden, labels)
    heads.draft_vocab = vocab
    counts = rank_counts(heads, weight, data)  # (1, MAX_RANK + 1)
    ranks = [int((logits[r, vocab] > logits[r, inside]).sum()) for r in (0, 3, 4, 5)]
    expected = torch.bincount(torch.tensor([*ranks, MAX_RANK]), minlength=MAX_RANK + 1)
    assert ranks[0] == 0 and torch.equal(counts[0], expected)
    settings = TrainSettings(data="-", out="-", num_heads=1, progress=False)
    with torch.no_grad():
        loss, _ = objective(heads, weight, data, settings).loss(torch.tensor([0, 3]))
        over_vocab = torch.log_softmax(logits[[0, 3]][:, vocab].float(), -1)
        column = int((vocab == inside).nonzero())
        assert torch.allclose(loss, -over_vocab[:, column].mean(), atol=1e-4)


def tiny_setup(tiny: tuple[Transformer, Tokenizer], tmp: Path) -> tuple[Features, TrainSettings]:
    model, _ = tiny
    samples = random_samples(12, seed=4, low=2, high=6)
    feats = extract(
        model,
        samples,
        generate=True,
        max_len=48,
        eos_ids=[2],
        cache_dir=tmp / "f",
        model_tag="t",
        progress=False,
    )
    settings = TrainSettings(
        data="-", out=str(tmp), num_heads=2, epochs=3, batch_size=32, lr=3e-3, save_every=4, progress=False
    )
    return feats, settings


def new_heads(model: Transformer) -> MedusaHeads:
    return MedusaHeads(2, 1, model.config.hidden_size, model.config.vocab_size)


def check_resume_is_exact(
    new_objective: Callable[[Common], Objective],
    settings: Common,
    tmp_path: Path,
    interrupt_at: int,
    **other: Any,
) -> nn.Module:
    """What every method's training loop must give (`new_objective(settings)`: a fresh module each
    call): a run interrupted by Ctrl-C after step `interrupt_at` finishes the step under way,
    checkpoints it and puts the caller's SIGINT handler back; resumed from the checkpoint with a
    fresh module, as a new process would, it ends with the weights of an uninterrupted run; and
    the checkpoint refuses settings with the `other` values. Returns the uninterrupted run's module."""
    straight = new_objective(settings)
    train_loop(straight, tmp_path / "straight.pt")

    def ctrl_c(step: int) -> None:
        if step == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)

    state = tmp_path / "resumed.pt"
    before = signal.getsignal(signal.SIGINT)  # default, or ignored under a shell's background job
    with pytest.raises(KeyboardInterrupt):
        train_loop(new_objective(settings), state, on_step=ctrl_c)
    assert torch.load(state, weights_only=True)["step"] == interrupt_at + 1  # never inside a step
    assert signal.getsignal(signal.SIGINT) is before  # the loop put the caller's handler back
    resumed = new_objective(settings)  # a fresh process: everything comes from the checkpoint
    train_loop(resumed, state)
    expected = straight.module.state_dict()
    for (name, a), b in zip(expected.items(), resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(SpecDecodeError, match="other settings"):
        train_loop(new_objective(replace(settings, **other)), state)
    return straight.module


def test_resumed_training_ends_where_an_uninterrupted_run_does(
    tiny: tuple[Transformer, Tokenizer], tmp_path: Path
) -> None:
    model, _ = tiny
    feats, settings = tiny_setup(tiny, tmp_path)
    data = positions(feats, 2)
    weight = model.head_weight_t().detach()
    straight = check_resume_is_exact(
        lambda s: objective(new_heads(model), weight, data, s), settings, tmp_path, 7, lr=1e-2
    )
    assert not torch.equal(
        straight.state_dict()["blocks.0.0.linear.weight"], new_heads(model).blocks[0][0].linear.weight
    )


def check_trained_run(
    model_dir: Path, argv: list[str], speculative: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    """What every `specdecode train METHOD` run must give: the trained drafter decodes (with each
    of the `speculative` settings) exactly like plain greedy; running `argv` again refuses to
    overwrite without --resume; and a resumed finished run succeeds (re-exported from its checkpoint)."""
    llm = LLM(model=str(model_dir), progress=False)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for spec in speculative:
        for text in ("the cat", "a"):
            assert (
                llm.generate(text, params, speculative=spec)[0].token_ids
                == llm.generate(text, params, speculative=None)[0].token_ids
            ), (spec, text)
    assert main(argv) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0


class TrainRun(NamedTuple):
    argv: list[str]  # the command line
    out: Path  # its --out
    printed: str
    report: dict[str, Any]  # OUT/report.json


def run_train_command(
    method: str, model_dir: Path, tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> TrainRun:
    """`specdecode train METHOD` as every method's end-to-end test runs it, with the method's own
    `flags`: self-distilled on a tiny ShareGPT file (30 conversations, 5 held out), float32, τ on
    2 held-out prompts of 24 tokens. The run must succeed and print its held-out τ."""
    data = tmp_path / "sharegpt.json"
    write_sharegpt(data, 30)
    out = tmp_path / method
    argv = [
        "train", method, "--model", str(model_dir), "--data", str(data), "--out", str(out),
        "--max-len", "96", "--epochs", "2", "--heldout", "5", "--eval-prompts", "2", "--eval-tokens", "24",
        "--dtype", "float32", "--self-distill", "--feature-batch-size", "8", *flags,
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "held-out τ" in printed
    return TrainRun(argv, out, printed, json.loads((out / "report.json").read_text()))


def test_train_command_end_to_end(
    tiny_chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdecode train medusa` on a tiny ShareGPT file: heads, config and report written, the
    heads decode exactly like plain greedy, and a second run needs --resume."""
    flags = ["--num-heads", "2", "--batch-size", "64", "--tree-nodes", "6", "--draft-vocab", "40"]
    argv, out, printed, report = run_train_command("medusa", tiny_chat_dir, tmp_path, flags, capsys)
    assert "held-out top-1 accuracy per head" in printed and "draft vocabulary: 40 ids" in printed
    assert len(report["heldout_top1"]) == 2 and report["heldout_tau"] >= 1.0
    assert 0.5 < report["draft_vocab_heldout_coverage"] <= 1.0
    heads = load_heads(out)
    assert heads.num_heads == 2 and heads.choices is not None and len(heads.choices) == 6
    assert heads.draft_vocab is not None and heads.draft_vocab.numel() == 40
    assert (out / "medusa.safetensors").stat().st_size < 100_000  # shared LM head: blocks only

    check_trained_run(tiny_chat_dir, argv, [{"method": "medusa", "heads": str(out)}], capsys)
