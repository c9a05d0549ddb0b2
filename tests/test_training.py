"""Training really learns, and run.json carries the contract other tools read."""

from __future__ import annotations

import torch

from tests.conftest import ranktrace
from trainer.config import MODELS

RUN_JSON_KEYS = {
    "run_id",
    "name",
    "status",
    "layout",
    "world_size",
    "model",
    "n_params",
    "precision",
    "steps",
    "losses",
    "tokens_per_s",
}


def test_small_model_loss_falls_on_the_stdlib_corpus(runs_dir):
    result = ranktrace(
        "train",
        "--model",
        "small",
        "--steps",
        "60",
        "--global-batch",
        "8",
        "--micro-batches",
        "1",
        "--seq-len",
        "128",
        "--run-name",
        "learns",
        "--save-weights",
        runs_dir=runs_dir,
    )
    assert result.returncode == 0, result.stderr
    record = result.run()
    assert record.keys() >= RUN_JSON_KEYS
    assert record["status"] == "completed" and record["name"] == "learns"
    assert record["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero": 0}
    assert len(record["losses"]) == 60 and record["tokens_per_s"] > 0
    first, last = record["losses"][0], sum(record["losses"][-5:]) / 5
    assert first > 5.0  # ~ln(256) = 5.55: the model starts knowing nothing
    assert last < 3.2, f"loss fell only from {first:.2f} to {last:.2f}"
    weights = torch.load(runs_dir / record["run_id"] / "weights.pt", weights_only=True)
    n_params = sum(t.numel() for t in weights["params"].values())
    assert n_params == record["n_params"] == MODELS["small"].n_params()
    assert record["run_id"] in result.stdout and "step    60/60" in result.stdout
