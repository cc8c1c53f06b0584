"""SamplingParams validation and the logits -> target-distribution transform."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams, argmax_rows, logits_to_probs, token_logprobs


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_values_name_the_setting(kwargs: dict, needle: str) -> None:
    with pytest.raises(SpecDecodeError, match=needle):
        SamplingParams(**kwargs)


def test_token_logprobs_are_the_raw_log_softmax_with_the_top_sorted() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625], [0.1, 0.2, 0.3, 0.15, 0.25]]))
    out = token_logprobs(logits * 3.0 + 1.0, [3, 0], 2)  # scale: the logprobs are not the logits'
    expected = torch.log_softmax(logits * 3.0, -1)
    assert [o.logprob for o in out] == pytest.approx([float(expected[0, 3]), float(expected[1, 0])])
    assert [[t for t, _ in o.top] for o in out] == [[0, 1], [2, 4]]
    assert out[1].top[0][1] == pytest.approx(float(expected[1, 2])) and out[1].top[0][1] > out[1].top[1][1]
    assert token_logprobs(logits, [1, 1], 0)[0].top == []


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.25, 0.125, 0.0625, 0.0625]),
        (SamplingParams(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0, 0]),
        # top_p keeps the smallest head whose mass reaches p: 0.5 + 0.25 >= 0.7
        (SamplingParams(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.45), [1, 0, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.76), [4 / 7, 2 / 7, 1 / 7, 0, 0]),
    ],
)
def test_logits_to_probs(params: SamplingParams, expected: list[float]) -> None:
    torch.testing.assert_close(logits_to_probs(LOGITS, params), torch.tensor(expected, dtype=torch.float32))


def test_temperature_sharpens() -> None:
    p = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    q = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]) ** 2
    torch.testing.assert_close(p, q / q.sum())


def test_seed_makes_sampling_reproducible(tiny_model_dir) -> None:
    from specdecode.models.transformer import Transformer
    from tests.alone import alone

    model = Transformer.from_dir(tiny_model_dir)

    def run(seed: int) -> list[int]:
        req, steps = alone(model, [3, 4, 5], SamplingParams(max_tokens=20, seed=seed, ignore_eos=True), [2])
        list(steps)
        return req.output_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_argmax_rows_resolves_as_torch_argmax(dtype: torch.dtype) -> None:
    """Greedy tokens come from `argmax_rows` (numpy's argmax on a CPU): the same index as
    `torch.argmax` for ties (the first), NaN (counted largest), infinities and all -inf rows."""
    nan, inf = float("nan"), float("inf")
    special = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf], [inf, 1.0, inf, 0.0]]
    )
    g = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (64, 300), generator=g).float()  # many equal maxima a row
    wide = torch.randn(5, 49152, generator=g)
    for rows in (special, ties, wide):
        rows = rows.to(dtype)
        assert argmax_rows(rows) == rows.argmax(-1).tolist()
        assert argmax_rows(rows[:1]) == [int(rows[0].argmax())]
