"""End-to-end proof of the parallel layouts: every (tp, pp, dp, zero) layout, launched through the
real `ranktrace train`, matches the single-process run of the same global batch and seed.

Tolerances (fp32, 3 steps of AdamW at lr 3e-3 on `tiny`), with the worst differences measured
over these layouts on 2 cores in brackets:
- per-step loss and global gradient norm: 1e-5 relative [loss 1.9e-7, norm 3.8e-7];
- gradients of the last step: 5e-5 × the largest gradient element, absolute [4.9e-6];
- parameters after the last step: 1e-4 absolute, about 1% of the ~9e-3 that three AdamW steps
  move a weight [3.1e-5]. AdamW divides by sqrt(v), so summation-order noise in near-zero
  gradients moves parameters more than it moves losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

STEPS = 3
LOSS_RTOL = 1e-5
GRAD_RTOL = 5e-5
PARAM_ATOL = 1e-4
COMMON = (
    "--model",
    "tiny",
    "--steps",
    str(STEPS),
    "--precision",
    "fp32",
    "--global-batch",
    "8",
    "--seq-len",
    "32",
    "--save-weights",
)


def train_fp32(runs_dir: Path, *layout: str) -> tuple[dict, dict]:
    """Run one layout; returns (run.json, consolidated weights and grads)."""
    result = ranktrace("train", *COMMON, *layout, runs_dir=runs_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    record = result.run()
    weights = torch.load(runs_dir / record["run_id"] / "weights.pt", weights_only=True)
    return record, weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    return train_fp32(tmp_path_factory.mktemp("reference"), "--micro-batches", "2")


LAYOUTS = {
    "tp2": ("--tp", "2"),
    "pp2": ("--pp", "2"),
    "dp2": ("--dp", "2"),
    "tp2-pp2": ("--tp", "2", "--pp", "2"),
    "tp2-dp2": ("--tp", "2", "--dp", "2"),
    "pp2-dp2": ("--pp", "2", "--dp", "2"),
    "tp2-pp2-dp2": ("--tp", "2", "--pp", "2", "--dp", "2"),
    "dp2-zero1": ("--dp", "2", "--zero", "1"),
    "dp2-zero2": ("--dp", "2", "--zero", "2"),
    "tp2-pp2-dp2-zero1": ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1"),
    "tp2-pp2-dp2-zero2": ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "2"),
    "tp2-dp2-sequence-parallel": ("--tp", "2", "--dp", "2", "--sequence-parallel"),
    "pp2-gpipe-4-micro": ("--pp", "2", "--schedule", "gpipe", "--micro-batches", "4"),
    "tp4": ("--tp", "4"),
    "pp4-1f1b-4-micro": ("--pp", "4", "--micro-batches", "4"),
    "pp2-uneven-stage-layers": ("--pp", "2", "--stage-layers", "3,1"),
    "pp2-dp2-pp-innermost": ("--pp", "2", "--dp", "2", "--rank-order", "pp-dp-tp"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, tmp_path, name):
    assert_matches(reference, train_fp32(tmp_path / "runs", *LAYOUTS[name]))


VARIABLE_LENGTHS = ("--seq-len-dist", "uniform:8,32")
"""Each micro-batch its own length (trainer/lengths.py): the lengths follow the global
micro-batch, so one process with dp*micro-batches micro-batches sees the same ones."""


def test_variable_length_batches_match_single_process_in_3d(tmp_path):
    reference = train_fp32(tmp_path / "one", "--micro-batches", "4", *VARIABLE_LENGTHS)
    layout = ("--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2")
    assert_matches(reference, train_fp32(tmp_path / "3d", *layout, *VARIABLE_LENGTHS))


def assert_matches(reference: tuple[dict, dict], got: tuple[dict, dict]) -> None:
    """Losses, gradient norms, last gradients and parameters within the tolerances above."""
    (ref_record, ref_weights), (record, weights) = reference, got
    assert len(record["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(record["losses"], ref_record["losses"], strict=True)):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: loss {got} vs {want}"
    for got, want in zip(record["grad_norms"], ref_record["grad_norms"], strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"grad norm {got} vs {want}"

    assert weights["params"].keys() == ref_weights["params"].keys()
    grad_scale = max(g.abs().max().item() for g in ref_weights["grads"].values())
    for key, want in ref_weights["grads"].items():
        worst = (weights["grads"][key] - want).abs().max().item()
        assert worst <= GRAD_RTOL * grad_scale, f"grad of {key} differs by {worst}"
    for key, want in ref_weights["params"].items():
        worst = (weights["params"][key] - want).abs().max().item()
        assert worst <= PARAM_ATOL, f"{key} differs by {worst} after {STEPS} steps"
