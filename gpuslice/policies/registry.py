"""Policy names, resolved once (at start-up or CLI parsing), and the one place weights combine.

A spec is a name (``"fragmentation"``) or a weighted sum (``"fragmentation:0.8,spread:0.2"``); the
combined score is sum(w_i * s_i) / sum(w_i), still in [0, 1]. Other modules may add policies with
:func:`register` (the extender adds ``utilization`` and ``cost``).

**No signal, no effect.** A part whose score is the same for every candidate of a decision (``cost``
in a cluster without prices, ``utilization`` without fresh samples) says nothing about the choice;
it is left out of that decision, weight included: the sum is taken over the parts that do vary and
divided by *their* weights (when none varies, the first policy's constant stands). So
``fragmentation:1,cost:1`` on a cluster without prices scores exactly as ``fragmentation`` alone,
bit for bit, and the narrowed filter's ``margin`` (an absolute
score distance) keeps its meaning instead of shrinking by 1/1.3. Secondary orders are summed as
given; a policy with no signal returns a zero secondary (``cost``, ``utilization``) for the same
reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpuslice.packing.errors import UnknownPolicyError, WeightError
from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies import (
    bestfit,
    binpack,
    cost,
    dotprod,
    fgd,
    fragmentation,
    gpuclustering,
    gpupacking,
    random,
    spread,
    utilization,
)
from gpuslice.policies.base import F64, Policy, PolicyContext

_POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        fragmentation.POLICY, bestfit.POLICY, binpack.POLICY, spread.POLICY, random.POLICY,
        fgd.POLICY, dotprod.POLICY, gpuclustering.POLICY, gpupacking.POLICY, cost.POLICY, utilization.POLICY,
    )
}


def register(policy: Policy) -> None:
    """Add a policy under ``policy.name`` (replacing one of the same name)."""
    _POLICIES[policy.name] = policy


def known() -> tuple[str, ...]:
    return tuple(sorted(_POLICIES))


def get(name: str) -> Policy:
    try:
        return _POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name, known()) from None


class Weighted:
    """A weighted sum of policies; memory is the tuple of their memories."""

    def __init__(self, parts: Mapping[str, float]) -> None:
        if not parts:
            raise WeightError("no policies given")
        for name, w in parts.items():
            if not math.isfinite(w) or w < 0:
                raise WeightError(f"weight of {name} must be a finite number >= 0, got {w}")
        total = sum(parts.values())
        if total <= 0:
            raise WeightError("policy weights sum to zero")
        self.parts: tuple[tuple[Policy, float], ...] = tuple((get(n), w / total) for n, w in parts.items())
        self.name = ",".join(f"{n}:{w:g}" for n, w in parts.items()) if len(parts) > 1 else next(iter(parts))

    def new_memory(self, ctx: PolicyContext) -> Any:
        return tuple(p.new_memory(ctx) for p, _ in self.parts)

    def observe(self, memory: Any, req: PackRequest) -> None:
        for (p, _), m in zip(self.parts, memory, strict=True):
            p.observe(m, req)

    def memory_token(self, memory: Any) -> object:
        return tuple(p.memory_token(m) for (p, _), m in zip(self.parts, memory, strict=True))

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return self.score_parts(state, req, cands, memory)[0]

    def score_parts(self, state: ClusterState, req: PackRequest, cands: Candidates,
                    memory: Any) -> tuple[F64, dict[str, F64]]:
        """The combined score and each policy's own score per candidate (the assignment's breakdown:
        what an operator reads to see why a placement won; the parts cost nothing extra)."""
        scores = [(np.asarray(p.score(state, req, cands, m), dtype=np.float64), w)
                  for (p, w), m in zip(self.parts, memory, strict=True)]
        parts = {p.name: s for (p, _), (s, _) in zip(self.parts, scores, strict=True)}
        if len(scores) == 1:
            return scores[0][0], parts
        varying = [(s, w) for s, w in scores if w > 0 and s.shape[0] > 1 and float(np.ptp(s)) > 0.0]
        if not varying:  # nothing tells the candidates apart: the first (primary) policy's constant
            varying = [next((sw for sw in scores if sw[1] > 0), scores[0])]
        total = sum(w for _, w in varying)
        if total <= 0:
            return np.zeros(len(cands)), parts
        if len(varying) == 1:
            return varying[0][0].copy(), parts
        out = np.zeros(len(cands))
        for s, w in varying:
            out += (w / total) * s
        return out, parts

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        out = np.zeros(len(cands))
        for (p, w), m in zip(self.parts, memory, strict=True):
            out += w * p.secondary(state, req, cands, m)
        return out


def parse_spec(spec: str) -> dict[str, float]:
    """``"a"`` -> {a: 1}; ``"a:0.7,b:0.3"`` -> {a: 0.7, b: 0.3}; names checked, weights validated."""
    parts: dict[str, float] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, weight = item.partition(":")
        get(name.strip())
        try:
            parts[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise WeightError(f"weight of {name.strip()} is not a number: {weight!r}") from None
    return parts


def resolve(spec: str | Mapping[str, float]) -> Weighted:
    """Resolve a spec once; unknown names raise :class:`UnknownPolicyError` listing the known ones."""
    return Weighted(parse_spec(spec) if isinstance(spec, str) else dict(spec))
