"""Training data without downloads: a byte-level corpus from the Python standard library's source
(vocab 256), or synthetic tokens; batches are a pure function of (seed, step), sharded over dp.

Every rank computes the same global batch of the step and takes its rows, so the global batch is
identical for any (tp, pp, dp) layout; that is what makes parity with one process possible.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator

import torch

from ranktrace.trainer.lengths import MicroBatchLengths

CORPUS_BYTES = 8 * 2**20  # 8 MiB of source is plenty for the models trained here


def _source_files(directory: str) -> Iterator[str]:
    """`.py` files under `directory` in sorted path order (the order of sorted(rglob("*.py"))),
    lazily, so a caller that has enough stops the walk; skips site-packages and test folders
    and, as rglob does, does not follow links to folders."""
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in ("site-packages", "test"):
                yield from _source_files(entry.path)
        elif entry.name.endswith(".py"):
            yield entry.path


def read_stdlib_corpus(max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """The standard library's .py files in sorted path order, concatenated, as uint8 [N] (N at
    most `max_bytes`); a file that cannot be read is left out whole. Read straight into one
    buffer: every rank reads it at start (0.15 s of CPU a rank under load, py-spy), and the
    three copies joining, cutting and copying the files' bytes took half of it."""
    stdlib = sysconfig.get_paths()["stdlib"]
    buffer = bytearray(max_bytes)
    view, total = memoryview(buffer), 0
    for path in _source_files(stdlib):
        if total == max_bytes:
            break
        begun = total
        try:
            with open(path, "rb", buffering=0) as source:
                while total < max_bytes and (read := source.readinto(view[total:])):
                    total += read
        except OSError:
            total = begun  # what it gave before failing is dropped
    view.release()
    if total == 0:
        raise RuntimeError(f"no Python source found under {stdlib}; use --data synthetic")
    del buffer[total:]
    return torch.frombuffer(buffer, dtype=torch.uint8)


class BatchSource:
    """Global batches of token sequences [global_batch, seq_len + 1] for any step."""

    def __init__(
        self, kind: str, seq_len: int, global_batch: int, vocab_size: int, seed: int,
        lengths: MicroBatchLengths | None = None,
    ) -> None:  # fmt: skip
        """`lengths`: each micro-batch cut to its own length (trainer/lengths.py); None: all
        seq_len tokens."""
        self.kind, self.seq_len, self.global_batch = kind, seq_len, global_batch
        self.vocab_size, self.seed, self.lengths = vocab_size, seed, lengths
        self.corpus = read_stdlib_corpus() if kind == "text" else None

    def global_batch_at(self, step: int) -> torch.Tensor:
        """Token ids int64 [global_batch, seq_len + 1]; inputs are [:, :-1], targets [:, 1:]."""
        generator = torch.Generator().manual_seed(self.seed * 100_003 + step)
        span = self.seq_len + 1
        if self.corpus is None:
            shape = (self.global_batch, span)
            return torch.randint(0, self.vocab_size, shape, generator=generator)
        starts = torch.randint(
            0, len(self.corpus) - span, (self.global_batch,), generator=generator
        )
        offsets = starts.unsqueeze(1) + torch.arange(span)  # [B, S+1]
        return self.corpus[offsets].long()

    def micro_batches(self, step: int, dp_rank: int, dp: int, n_micro: int) -> list[torch.Tensor]:
        """This dp rank's contiguous share of the step's batch, split into `n_micro` pieces,
        each cut to its micro-batch's length where lengths vary."""
        rows = self.global_batch_at(step).chunk(dp, dim=0)[dp_rank]  # [B/dp, S+1]
        pieces = list(rows.chunk(n_micro, dim=0))  # n_micro × [B/(dp·M), S+1]
        if self.lengths is None:
            return pieces
        return [piece[:, : self.lengths.length(step, dp_rank, mb) + 1]  # [b, L_mb + 1]
                for mb, piece in enumerate(pieces)]  # fmt: skip
