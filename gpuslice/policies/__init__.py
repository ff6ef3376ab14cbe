"""Packing policies, one module each; :mod:`gpuslice.policies.registry` resolves names."""
