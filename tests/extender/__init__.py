"""Tests of the scheduler extender's modules (wire, informer, lease, signals, metrics)."""
