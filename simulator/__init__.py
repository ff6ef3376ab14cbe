"""Replaying workloads through the packing policies: the engine behind ``gpu-slice simulate``."""
