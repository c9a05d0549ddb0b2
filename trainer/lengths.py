"""Variable-length batches: each micro-batch takes its own sequence length (`--seq-len-dist`).

Real training data varies in length; without packing, a micro-batch of long sequences takes
longer than one of short ones, and since every dp rank waits for the others at the gradient
reduction (and a pipeline stage for its neighbours), which rank is slowest changes from step to
step: a random imbalance, nobody's fault. Here each micro-batch's sequences are cut to one
length (no padding, no packing), drawn per (step, global micro-batch) from the distribution.

A global micro-batch is unit `dp_rank * micro_batches + mb`: the same rows a single process
with dp * micro_batches micro-batches takes, so a dp=2, 2-micro-batch run and a dp=1,
4-micro-batch one see the same sequences at the same lengths (the parity tests' reference).

`--length-buckets N` (the usual remedy: length-grouped batches) hands out the step's lengths so
that the micro-batches the dp ranks run at the same time come from one of N equal ranges of
lengths: the step's lengths are ordered by range, and wave m (micro-batch m of every dp rank)
takes the next dp of them, dealt to the ranks in turn, the order reversed every wave, so that
no rank always gets the longest of each wave (its sum, what a step with one gradient
reduction waits for, stays even). The lengths of a step are the same, only placed otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ranktrace.trainer.config import ConfigError

FORMS = ("uniform",)


@dataclass(frozen=True)
class LengthDistribution:
    """`uniform:MIN,MAX`: integer lengths, both ends included."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, seq_len: int) -> LengthDistribution:
        """The distribution `text` names; ConfigError for anything else, or lengths outside
        [2, seq_len] (each micro-batch is cut from sequences of seq_len + 1 tokens)."""
        form, _, values = text.partition(":")
        if form not in FORMS:
            raise ConfigError(f"--seq-len-dist={text}: unknown form '{form}'; use "
                              f"uniform:MIN,MAX (e.g. uniform:16,{seq_len})")  # fmt: skip
        try:
            low, high = (int(v) for v in values.split(","))
        except ValueError:
            raise ConfigError(f"--seq-len-dist={text}: give two integer lengths, "
                              f"uniform:MIN,MAX (e.g. uniform:16,{seq_len})") from None  # fmt: skip
        if not 2 <= low <= high <= seq_len:
            raise ConfigError(f"--seq-len-dist={text}: need 2 <= MIN <= MAX <= --seq-len="
                              f"{seq_len}")  # fmt: skip
        return cls(low, high)


class MicroBatchLengths:
    """Every micro-batch's sequence length, a pure function of (seed, step, dp rank, index)."""

    def __init__(self, distribution: LengthDistribution, seed: int, dp: int, n_micro: int,
                 buckets: int = 0) -> None:  # fmt: skip
        self.distribution, self.seed, self.dp, self.n_micro = distribution, seed, dp, n_micro
        self.buckets = buckets
        self._step: int | None = None
        self._lengths: list[int] = []

    def length(self, step: int, dp_rank: int, mb: int) -> int:
        """Sequence length of micro-batch `mb` of `dp_rank` at `step`."""
        if step != self._step:
            self._step, self._lengths = step, self._draw(step)
        return self._lengths[dp_rank * self.n_micro + mb]

    def tokens(self, step: int, micro_batch_size: int) -> int:
        """Tokens of the whole job at `step` (every dp rank's micro-batches)."""
        self.length(step, 0, 0)
        return micro_batch_size * sum(self._lengths)

    def _draw(self, step: int) -> list[int]:
        """The step's lengths by global unit (module docstring)."""
        d = self.distribution
        generator = torch.Generator().manual_seed(self.seed * 7_919 + step)
        units = self.dp * self.n_micro
        lengths = torch.randint(d.low, d.high + 1, (units,), generator=generator).tolist()
        if self.buckets <= 0:
            return lengths
        width = (d.high - d.low + 1) / self.buckets
        tiebreak = torch.rand(units, generator=generator).tolist()
        order = sorted(range(units), key=lambda u: (int((lengths[u] - d.low) // width),
                                                    tiebreak[u]))  # fmt: skip
        placed = [0] * units
        for position, unit in enumerate(order):  # wave m holds positions m*dp .. m*dp + dp-1,
            wave, offset = divmod(position, self.dp)  # dealt in turn, the order reversed every
            rank = offset if wave % 2 == 0 else self.dp - 1 - offset  # wave: even rank sums
            placed[rank * self.n_micro + wave] = lengths[unit]
        return placed


def micro_batch_lengths(cfg) -> MicroBatchLengths | None:
    """The run's micro-batch lengths (`cfg`: a TrainConfig), or None where every sequence is
    seq_len tokens."""
    if not cfg.seq_len_dist:
        return None
    distribution = LengthDistribution.parse(cfg.seq_len_dist, cfg.seq_len)
    return MicroBatchLengths(distribution, cfg.seed, cfg.dp, cfg.micro_batches,
                             cfg.length_buckets)  # fmt: skip
