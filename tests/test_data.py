"""Training data: real bytes from the standard library, batches that depend only on (seed, step),
and dp shards that partition the global batch exactly."""

from __future__ import annotations

import torch

from ranktrace.trainer.data import BatchSource, read_stdlib_corpus
from ranktrace.trainer.lengths import LengthDistribution, MicroBatchLengths


def test_corpus_is_python_source_bytes():
    corpus = read_stdlib_corpus(max_bytes=1 << 20)
    assert corpus.dtype == torch.uint8 and len(corpus) == 1 << 20
    text = bytes(corpus[:200_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert len(torch.unique(corpus)) > 60  # real text, not a constant or a tiny alphabet


def test_batches_are_a_function_of_seed_and_step():
    a = BatchSource("text", seq_len=16, global_batch=4, vocab_size=256, seed=7)
    b = BatchSource("text", seq_len=16, global_batch=4, vocab_size=256, seed=7)
    assert torch.equal(a.global_batch_at(3), b.global_batch_at(3))
    assert not torch.equal(a.global_batch_at(3), a.global_batch_at(4))
    other_seed = BatchSource("text", seq_len=16, global_batch=4, vocab_size=256, seed=8)
    assert not torch.equal(a.global_batch_at(3), other_seed.global_batch_at(3))
    assert a.global_batch_at(0).shape == (4, 17)


def test_dp_shards_and_micro_batches_partition_the_global_batch():
    source = BatchSource("text", seq_len=8, global_batch=12, vocab_size=256, seed=1)
    whole = source.global_batch_at(5)
    pieces = [
        mb for dp_rank in range(3) for mb in source.micro_batches(5, dp_rank, dp=3, n_micro=2)
    ]
    assert all(p.shape == (2, 9) for p in pieces)
    assert torch.equal(torch.cat(pieces), whole)


def test_synthetic_tokens_cover_the_vocabulary_without_reading_files():
    source = BatchSource("synthetic", seq_len=64, global_batch=8, vocab_size=256, seed=1)
    assert source.corpus is None
    batch = source.global_batch_at(0)
    assert batch.min() >= 0 and batch.max() < 256 and len(torch.unique(batch)) > 200


def test_variable_lengths_cut_each_micro_batch_and_follow_the_global_micro_batch():
    """dp=2 with 2 micro-batches and one process with 4 see the same lengths, unit by unit."""
    uniform = LengthDistribution.parse("uniform:4,16", seq_len=16)
    two = MicroBatchLengths(uniform, seed=3, dp=2, n_micro=2)
    one = MicroBatchLengths(uniform, seed=3, dp=1, n_micro=4)
    assert [two.length(5, d, m) for d in range(2) for m in range(2)] == [
        one.length(5, 0, m) for m in range(4)]  # fmt: skip
    source = BatchSource("text", seq_len=16, global_batch=8, vocab_size=256, seed=1, lengths=two)
    pieces = source.micro_batches(5, dp_rank=1, dp=2, n_micro=2)
    assert [p.shape for p in pieces] == [(2, two.length(5, 1, m) + 1) for m in range(2)]
    assert two.tokens(5, micro_batch_size=2) == 2 * sum(
        two.length(5, d, m) for d in range(2) for m in range(2))  # fmt: skip


def test_length_buckets_put_like_lengths_in_the_micro_batches_ranks_run_together():
    """dp=4 x 4 micro-batches from 4..64 over 200 steps: the widest gap between the lengths
    the dp ranks run at one micro-batch index is 49 tokens on average as drawn, 19 bucketed
    by 8 ranges (measured); the step's lengths are the same, only placed otherwise."""
    uniform = LengthDistribution.parse("uniform:4,64", seq_len=64)
    drawn = MicroBatchLengths(uniform, seed=9, dp=4, n_micro=4)
    bucketed = MicroBatchLengths(uniform, seed=9, dp=4, n_micro=4, buckets=8)

    def spread(lengths: MicroBatchLengths, step: int) -> int:
        """The widest gap between the dp ranks' lengths of one micro-batch index."""
        waves = [[lengths.length(step, d, m) for d in range(4)] for m in range(4)]
        return max(max(wave) - min(wave) for wave in waves)

    units = [(d, m) for d in range(4) for m in range(4)]
    for step in range(200):
        assert sorted(drawn.length(step, *u) for u in units) == sorted(
            bucketed.length(step, *u) for u in units)  # fmt: skip
    mean = {name: sum(spread(lengths, s) for s in range(200)) / 200
            for name, lengths in (("drawn", drawn), ("bucketed", bucketed))}  # fmt: skip
    assert mean["drawn"] > 40 and mean["bucketed"] < 0.5 * mean["drawn"], mean
