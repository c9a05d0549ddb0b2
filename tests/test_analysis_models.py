"""The analysis building blocks on known inputs: the memory model's arithmetic, the peers'
robust reference, MFU change points, and the one-axis sweep's validation."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.efficiency import change_points
from analysis.memory import ModelShape, predict
from analysis.stragglers import _peer_reference
from app.sweep import parse_values, sweep_configs
from trainer.config import MODELS, ConfigError, TrainConfig

SEVEN_B = ModelShape(**{k: getattr(MODELS["7b"], k) for k in ModelShape.__dataclass_fields__})


def test_seven_b_needs_sixteen_bytes_per_parameter_without_sharding():
    (rank,) = predict(SEVEN_B, tp=1, pp=1, dp=8, zero=0)
    n_params = MODELS["7b"].n_params()
    assert rank.state_bytes == 16 * n_params
    assert rank.state_bytes / 1e9 == pytest.approx(108, rel=0.01)  # 6.74B params


def test_sharding_divides_state_as_the_zero_paper_says():
    n = MODELS["7b"].n_params()
    (zero1,) = predict(SEVEN_B, tp=1, pp=1, dp=8, zero=1)
    assert zero1.state_bytes == 2 * n + 2 * n + 12 * n // 8
    (zero2,) = predict(SEVEN_B, tp=1, pp=1, dp=8, zero=2)
    assert zero2.grads_bytes == 2 * n // 8
    (whole_grads,) = predict(SEVEN_B, tp=1, pp=1, dp=8, zero=2, grads_sharded=False)
    assert whole_grads.grads_bytes == 2 * n  # the reference trainer's full gradient buffer
    stages = predict(SEVEN_B, tp=8, pp=4, dp=1, zero=0)
    total = sum(s.params_bytes for s in stages) * 8
    replicated_norms = 32 * 2 * 4096 * 7 * 2  # two norms per layer, on 7 more tp ranks, 2 B
    assert total == 2 * n + replicated_norms + 4096 * 7 * 2  # and the final norm


def test_one_f_one_b_keeps_fewer_micro_batches_alive_than_gpipe():
    gpipe = predict(SEVEN_B, 1, 4, 1, 0, micro_batches=8, schedule="gpipe")
    one_f = predict(SEVEN_B, 1, 4, 1, 0, micro_batches=8, schedule="1f1b")
    assert len({s.activation_bytes for s in gpipe}) == 1  # every stage keeps all 8 alive
    assert [s.activation_bytes * 8 // gpipe[0].activation_bytes for s in one_f] == [4, 3, 2, 1]


def test_peer_reference_leaves_the_rank_itself_out():
    reference, scale = _peer_reference(np.array([1.0, 1.0, 2.0]))
    assert reference.tolist() == [1.5, 1.5, 1.0]
    reference, _ = _peer_reference(np.array([2.0, 1.0]))
    assert reference.tolist() == [1.0, 2.0]
    many = np.r_[np.ones(15), 3.0]
    reference, scale = _peer_reference(many)
    assert reference[-1] == 1.0 and scale[-1] == 0.0


def test_change_points_find_a_drop_and_ignore_noise():
    rng = np.random.default_rng(0)
    noise = 0.01 * rng.standard_normal(60)
    level = np.r_[np.full(30, 0.4), np.full(30, 0.3)]
    assert change_points(level + noise) == [30]
    assert change_points(0.4 + noise) == []


def test_sweep_validates_every_value_before_launching():
    base = TrainConfig(pp=2, dp=1)
    configs = sweep_configs(base, "tp", parse_values("1,2"))
    assert [(c.tp, c.pp, c.run_name) for c in configs] == [(1, 2, "sweep-tp-tp1"),
                                                            (2, 2, "sweep-tp-tp2")]  # fmt: skip
    with pytest.raises(ConfigError, match="value 3"):
        sweep_configs(base, "tp", [1, 3])
    with pytest.raises(ConfigError, match="two or more"):
        parse_values("2")
