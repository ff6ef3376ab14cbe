"""``--device-choice`` and ``--republish-every``: who picks a pod's device in a replay (issue 52).

* ``free`` (the default): the extender picks node and device together, as gpu-slice does today with
  the device plugin. Nothing here runs; every decision is exactly today's.
* ``first-fit``: DRA as a naive driver gets it. kube-scheduler's allocator gives the first fitting
  device in a fixed publication order (device position); the extender can only score each node by
  the device first fit will give there (:mod:`gpuslice.packing.first_fit`).
* ``steered``: the same allocator, but our policy publishes the order
  (:mod:`gpuslice.policies.device_order`) and republishes the nodes that changed after every
  placement and departure, before the next pod is scheduled; with ``--republish-every K`` only
  after every K-th event, and a publication reaches the scheduler one event late (the ResourceSlice
  update goes through the API server while the scheduler already works on the next pod), so the
  order in force lags the cluster by 1 to K events.

The decisions themselves stay in the core: the replay calls the same ``Scheduler`` methods, whose
``devices`` order this module keeps and republishes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gpuslice.errors import GpuSliceError
from gpuslice.packing.first_fit import PublishedOrder
from gpuslice.packing.state import PackRequest
from gpuslice.policies.device_order import DeviceSteering
from gpuslice.scheduler import Scheduler

if TYPE_CHECKING:
    from simulator.miglayouts import DynamicLayouts

DEVICE_CHOICES = ("free", "steered", "first-fit")
I64 = NDArray[np.int64]


class DeviceChoiceError(GpuSliceError):
    """``--device-choice`` / ``--republish-every`` that cannot make a run; the message names the flag."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """``kind``: one of :data:`DEVICE_CHOICES`; ``republish_every``: 0 = after every event, no lag."""

    kind: str = "free"
    republish_every: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_CHOICES:
            raise DeviceChoiceError(f"--device-choice must be one of {', '.join(DEVICE_CHOICES)}, got {self.kind!r}")
        if self.republish_every < 0:
            raise DeviceChoiceError(f"--republish-every must be >= 1, got {self.republish_every}")
        if self.republish_every and self.kind != "steered":
            raise DeviceChoiceError(
                f"--republish-every applies only to --device-choice steered: {self.kind} "
                + ("lets the extender pick the device; nothing is published" if self.kind == "free"
                   else "publishes one fixed order and never republishes"))

    @property
    def label(self) -> str:
        """How a report names the choice."""
        if self.kind == "steered":
            return "steered, " + (f"republished every {self.republish_every} events, seen one event late"
                                  if self.republish_every else "republished after every event")
        return {"free": "free (the extender picks the device)",
                "first-fit": "first-fit (DRA, fixed device order)"}[self.kind]


def choice_from_args(args: argparse.Namespace) -> DeviceChoice:
    """The flags' choice, refused by name when ``--republish-every`` is out of range or misplaced."""
    kind = getattr(args, "device_choice", None) or "free"
    every = getattr(args, "republish_every", None)
    if every is not None and every < 1:
        raise DeviceChoiceError(f"--republish-every must be >= 1 (events between republishes), got {every}")
    return DeviceChoice(kind, every or 0)


def refuse_dynamic_with_dra(dynamic: frozenset[str], choice: DeviceChoice | None) -> None:
    """Dynamic MIG layouts and a DRA device choice are not modelled together: under DRA the devices
    are the instances a driver published, and a re-cut would republish them, which no replay models."""
    if dynamic and choice is not None and choice.kind != "free":
        raise DeviceChoiceError(f"--device-choice {choice.kind} models DRA over static MIG layouts; it cannot be "
                                f"combined with dynamic MIG layouts ({', '.join(sorted(dynamic))}: --mig-layouts "
                                "or the config's migLayouts.<product>.dynamic); give --mig-layouts static")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The two flags, for ``gpu-slice simulate``."""
    g = parser.add_argument_group("device choice under DRA (traces and the built-in day)")
    g.add_argument("--device-choice", choices=DEVICE_CHOICES, default=None,
                   help="free: the extender picks node and device (today, the default); first-fit: DRA's "
                        "allocator takes the first fitting device in a fixed order and the extender scores "
                        "nodes by that device; steered: the same, in an order our policy publishes")
    g.add_argument("--republish-every", type=int, default=None, metavar="K",
                   help="steered only: republish after every K-th placement or departure, seen one event "
                        "late (default: after every event, no lag)")


class Driver:
    """The DRA side of one replay: the order first fit reads and, when steered, its republishing."""

    def __init__(self, sched: Scheduler, choice: DeviceChoice) -> None:
        self.sched = sched
        self.order = PublishedOrder(sched.state)
        sched.devices = self.order
        self.steering = DeviceSteering(sched) if choice.kind == "steered" else None
        self.every = choice.republish_every
        self.events = 0
        self._pending: tuple[I64, I64] | None = None

    def observe(self, req: PackRequest) -> None:
        """A pod arrived (the steering learns its representatives from the pods seen)."""
        if self.steering is not None:
            self.steering.observe(req)

    def event(self) -> None:
        """A placement or a departure happened: republish as the choice says."""
        if self.steering is None:
            return
        self.events += 1
        state = self.sched.state
        if not self.every:
            self.order.publish(state, *self.steering.orders())
            return
        if self._pending is not None:  # last republish's update reaches the scheduler now
            self.order.publish(state, *self._pending)
            self._pending = None
        if self.events % self.every == 0:
            self._pending = self.steering.orders()


def attach(sched: Scheduler, choice: DeviceChoice | None, layouts: DynamicLayouts | None = None) -> Driver | None:
    """A driver for ``choice`` over ``sched``; ``None`` for ``free`` (nothing changes). With ``layouts``
    (dynamic MIG layouts) the scheduler takes their instance order instead; the two are not modelled
    together (under DRA the devices are the instances a driver published)."""
    driver = None if choice is None or choice.kind == "free" else Driver(sched, choice)
    if layouts is not None:
        if driver is not None:
            raise ValueError("dynamic MIG layouts and a DRA device choice are not modelled together")
        sched.instance_order = layouts.instance_order
    return driver
