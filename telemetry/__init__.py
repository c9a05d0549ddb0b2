"""Recording of per-rank training telemetry (step, phase and collective timings, memory, MFU)."""
