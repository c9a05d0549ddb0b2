"""Training data: real bytes from the standard library, batches that depend only on (seed, step),
and dp shards that partition the global batch exactly."""

from __future__ import annotations

import torch

from ranktrace.trainer.data import BatchSource, read_stdlib_corpus


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
