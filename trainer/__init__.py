"""ranktrace's reference 3D-parallel (TP × PP × DP with ZeRO) trainer for CPU (gloo) and GPU (NCCL)."""
