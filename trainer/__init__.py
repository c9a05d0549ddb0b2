"""ranktrace's reference 3D-parallel trainer (TP × PP × DP with ZeRO), on CPU/gloo or GPU/NCCL."""
