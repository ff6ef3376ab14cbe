"""A seeded day of LLM serving: Deployment-like owners of 7B-70B models scaling with a diurnal curve.

Why it looks like this: inference fleets are many small Deployments (one per model and tenant),
each autoscaled on traffic that peaks in the working day, plus rollouts (new model revisions
replace replicas a batch at a time with surge) and batch-inference Jobs whose pods run for a fixed
time once started. Slice counts follow the memory floors with S=7: one H100 MPS slice is about
11.4 GiB and MIG profiles are 1g.10gb/1g.20gb/2g.20gb/3g.40gb/4g.40gb/7g.80gb, so a 7B fp16 model
(16 GiB floor) asks 2 slices, a 13B 3, a 70B AWQ 4, a 34B fp16 a whole GPU and a 70B fp16 two.

The workload is a list of owner-level events; which pod a scale-down removes is the engine's
business (ReplicaSet rules: Pending pods first, then the newest), because it depends on state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuslice.requests import ISOLATION_KEY, MEMORY_KEY, RESOURCE, SliceRequest, parse_request

DAY_S = 24 * 3600
STEP_S = 15 * 60  # autoscaler evaluation period of the simulated HPA
UTILIZATION_KEY = "example.com/simulated-utilization"

IsolationName = Literal["mig", "mps", "any"]
EventKind = Literal["create", "delete", "rollout", "delete-old"]


@dataclass(frozen=True, slots=True)
class Variant:
    """A servable model configuration: memory floor (GiB), slices, isolation, how popular it is."""

    name: str
    params_b: float
    precision: str
    memory_gib: float
    slices: int
    isolation: IsolationName = "any"
    weight: float = 1.0
    replicas: tuple[int, int] = (1, 4)  # (night minimum, peak maximum) before the seed's jitter
    utilization: float = 0.6  # mean busy fraction of its share at peak


# Memory floors = weights plus the smallest KV cache worth serving with (vLLM-style), in GiB.
VARIANTS: tuple[Variant, ...] = (
    Variant("bge-large-embed", 0.3, "fp16", 2, 1, weight=1.5, replicas=(1, 4), utilization=0.3),
    Variant("llama3-8b-awq", 8, "int4", 8, 1, weight=3, replicas=(1, 6)),
    Variant("mistral-7b-awq-tenant", 7, "int4", 6, 1, "mig", weight=2, replicas=(1, 4)),
    Variant("llama3-8b-1g20", 8, "fp16", 18, 1, "mig", weight=1, replicas=(1, 3)),
    Variant("mistral-7b", 7, "fp16", 16, 2, weight=3, replicas=(1, 6)),
    Variant("llama3-8b", 8, "fp16", 18, 2, weight=4, replicas=(1, 6)),
    Variant("qwen2-7b-tenant", 7, "fp16", 16, 2, "mig", weight=2, replicas=(1, 4)),
    Variant("codellama-34b-awq", 34, "int4", 20, 2, weight=1, replicas=(1, 3)),
    Variant("llama2-13b", 13, "fp16", 28, 3, weight=2, replicas=(1, 4)),
    Variant("mixtral-8x7b-awq", 47, "int4", 26, 3, weight=2, replicas=(1, 4)),
    Variant("llama3-70b-awq", 70, "int4", 40, 4, weight=2, replicas=(1, 4)),
    Variant("codellama-34b", 34, "fp16", 70, 7, weight=1, replicas=(1, 3), utilization=0.7),
    Variant("llama3-70b", 70, "fp16", 140, 14, weight=1, replicas=(1, 3), utilization=0.7),
    # Whole-GPU replicas of small models: the L4/L40S fleet's natural tenants.
    Variant("mistral-7b-whole", 7, "fp16", 16, 7, weight=2, replicas=(2, 10), utilization=0.7),
    Variant("llama3-8b-whole", 8, "fp16", 18, 7, weight=3, replicas=(2, 10), utilization=0.7),
    Variant("llama2-13b-whole", 13, "fp16", 28, 7, weight=1.5, replicas=(1, 6), utilization=0.7),
    Variant("mixtral-8x7b-awq-whole", 47, "int4", 26, 7, weight=1, replicas=(1, 5), utilization=0.7),
)

# Batch inference (offline evals, embeddings backfills): Jobs whose pods run a fixed time.
JOB_VARIANTS: tuple[Variant, ...] = (
    Variant("eval-llama3-8b", 8, "fp16", 18, 2, replicas=(2, 6), utilization=0.9),
    Variant("backfill-embed", 0.3, "fp16", 2, 1, replicas=(2, 8), utilization=0.9),
    Variant("eval-llama3-8b-whole", 8, "fp16", 18, 7, replicas=(1, 4), utilization=0.9),
    Variant("eval-llama2-13b", 13, "fp16", 28, 3, replicas=(1, 4), utilization=0.9),
)


@dataclass(frozen=True, slots=True)
class Owner:
    """A Deployment (or Job) and the pod template its replicas share."""

    name: str  # namespace/name, the owner key for owner spread
    kind: Literal["Deployment", "Job"]
    variant: Variant
    run_s: float = 0.0  # Jobs: how long each pod runs once placed; 0 for Deployments
    request: SliceRequest = field(init=False)

    def __post_init__(self) -> None:
        # Going through the real request parser keeps the scenario honest about what pods can ask.
        req = parse_request(self.pod_template())
        assert req is not None
        object.__setattr__(self, "request", req)

    def pod_template(self) -> dict[str, Any]:
        """The pod a replica is created from, as ``v1.Pod`` JSON (what the extender would read)."""
        v = self.variant
        annotations = {MEMORY_KEY: f"{v.memory_gib:g}Gi", UTILIZATION_KEY: str(round(v.utilization * 100))}
        if v.isolation != "any":
            annotations[ISOLATION_KEY] = v.isolation
        ns, _, name = self.name.partition("/")
        return {
            "metadata": {"namespace": ns, "generateName": f"{name}-", "annotations": annotations},
            "spec": {"containers": [{"name": "server", "resources": {"limits": {RESOURCE: str(v.slices)}}}]},
        }


@dataclass(frozen=True, slots=True, order=True)
class Event:
    """An owner-level change at ``time_s``: create/delete ``count`` pods, or start a rollout."""

    time_s: float
    seq: int
    kind: EventKind
    owner: str
    count: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Owners and their events over one simulated day, ordered by (time, seq)."""

    seed: int
    owners: tuple[Owner, ...]
    events: tuple[Event, ...]
    duration_s: float = DAY_S

    def owner(self, name: str) -> Owner:
        for o in self.owners:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def pods_created(self) -> int:
        return sum(e.count for e in self.events if e.kind == "create")

    def memory_floors(self) -> Mapping[str, float]:
        return {o.name: o.variant.memory_gib for o in self.owners}


def diurnal(hour: float, peak_hour: float) -> float:
    """Traffic share in [0, 1]: 1 at the peak hour, 0 twelve hours away (a raised cosine)."""
    return 0.5 * (1.0 + math.cos(2.0 * math.pi * (hour - peak_hour) / 24.0))


def _deployment_events(owner: str, lo: int, hi: int, peak: float, rng: random.Random, seq: list[int],
                       events: list[Event], rollouts: int) -> None:
    """HPA-like replica changes every STEP_S, plus ``rollouts`` surge rollouts at random hours."""
    def add(t: float, kind: EventKind, count: int = 0) -> None:
        seq[0] += 1
        events.append(Event(t, seq[0], kind, owner, count))

    rollout_at = sorted(rng.uniform(2 * 3600, DAY_S - 4 * 3600) for _ in range(rollouts))
    current = 0
    busy_until = -1.0
    for step in range(DAY_S // STEP_S):
        t = float(step * STEP_S)
        if t < busy_until:
            continue
        load = diurnal(t / 3600.0, peak) * rng.uniform(0.85, 1.15)
        desired = max(lo, min(hi, round(lo + (hi - lo) * load)))
        if desired > current:
            add(t, "create", desired - current)
        elif desired < current:
            add(t, "delete", current - desired)
        current = desired
        while rollout_at and rollout_at[0] <= t + STEP_S:
            start = max(t + 1.0, rollout_at.pop(0))
            add(start, "rollout")
            batch = max(1, math.ceil(current * 0.25))  # maxSurge 25 %
            done = 0
            when = start
            while done < current:
                n = min(batch, current - done)
                add(when, "create", n)
                when += rng.uniform(180.0, 600.0)  # model load time before old replicas go
                add(when, "delete-old", n)
                done += n
            busy_until = when


def generate(seed: int, *, owners: int = 44, jobs_per_hour: float = 1.5, scale: float = 1.5) -> Workload:
    """The built-in workload for ``seed``: ``owners`` Deployments plus Poisson batch Jobs.

    ``scale`` multiplies every Deployment's replica range; the default 1.5 puts the evening peak at
    about 80-85 % of the GPUs, where packing decides who waits.
    """
    rng = random.Random(seed)
    deployments: list[Owner] = []
    events: list[Event] = []
    seq = [0]
    counts: dict[str, int] = {}
    weights = [v.weight for v in VARIANTS]
    for _ in range(owners):
        v = rng.choices(VARIANTS, weights)[0]
        counts[v.name] = counts.get(v.name, 0) + 1
        name = f"serving/{v.name}-{counts[v.name]}"
        deployments.append(Owner(name, "Deployment", v))
        lo = max(1, round(v.replicas[0] * scale * rng.uniform(0.7, 1.3)))
        hi = max(lo, round(v.replicas[1] * scale * rng.uniform(0.7, 1.3)))
        peak = rng.gauss(14.0, 3.0)  # tenants in several time zones
        rollouts = rng.choices((0, 1, 2), (0.5, 0.4, 0.1))[0]
        _deployment_events(name, lo, hi, peak, rng, seq, events, rollouts)
    jobs: list[Owner] = []
    t = rng.expovariate(jobs_per_hour) * 3600 if jobs_per_hour > 0 else DAY_S
    while t < DAY_S - 3600:
        v = rng.choice(JOB_VARIANTS)
        name = f"batch/{v.name}-{len(jobs) + 1}"
        job = Owner(name, "Job", v, run_s=rng.uniform(1800.0, 3 * 3600.0))
        jobs.append(job)
        seq[0] += 1
        events.append(Event(t, seq[0], "create", name, rng.randint(*v.replicas)))
        t += rng.expovariate(jobs_per_hour) * 3600
    events.sort()
    return Workload(seed, tuple(deployments + jobs), tuple(events))
