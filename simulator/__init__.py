"""``gpu-slice simulate``: replays workloads through the same decision code as the extender."""
