"""One module per parallelism: tensor.py (TP/SP), pipeline.py (PP), data.py (DP/ZeRO)."""
