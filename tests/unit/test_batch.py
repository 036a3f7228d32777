"""TokenBatch's row views equal a batch built afresh from the same samples: the micro-batches
(`rows`) and the engine probe's every-token view (`whole`) never pad again."""

import pytest
import torch

from distflow.sample import Sample
from distflow.train.batch import TokenBatch

PAD = 0
SAMPLES = [
    Sample([5, 6, 7], [8, 9], [-0.1, -0.2], False),
    Sample([11], [], [], False),  # an empty response
    Sample([3, 4, 5, 6, 7, 8], [9, 10, 11], [-0.3] * 3, True, mask=[1, 0, 1]),  # an observation token
    Sample([2, 3], [4, 5, 6, 7], [-0.4] * 4, False),
]
FIELDS = ("input_ids", "attention_mask", "position_ids", "resp_len", "resp_mask")


def _assert_same(a: TokenBatch, b: TokenBatch) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), (name, x, y)


@pytest.mark.parametrize("idx", [[0], [1], [2, 0], [0, 1, 2, 3], [3, 1]])
def test_rows_and_whole_equal_fresh_batches(idx):
    batch = TokenBatch.from_samples(SAMPLES, PAD, torch.device("cpu"))
    picked = [SAMPLES[i] for i in idx]
    _assert_same(batch.rows(idx), TokenBatch.from_samples(picked, PAD, torch.device("cpu")))
    every_token = [Sample(s.prompt_ids[:1], s.prompt_ids[1:] + s.response_ids, [], False) for s in picked]
    _assert_same(batch.whole(idx), TokenBatch.from_samples(every_token, PAD, torch.device("cpu")))
