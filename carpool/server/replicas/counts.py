"""`--replicas N` (a fixed count) or `--replicas MIN:MAX` (Ray Serve's autoscaler keeps each model between the
two): parsed without Ray, so a bad value fails before anything starts."""

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaCount:
    min: int
    max: int

    @property
    def autoscaled(self) -> bool:
        return self.max > self.min

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.autoscaled else str(self.min)


def parse_replicas(text: str | int) -> ReplicaCount:
    """ "3" or "3:3" (fixed), "1:4" (autoscaled); ValueError naming --replicas for anything else."""
    parts = str(text).strip().split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"--replicas: expected N or MIN:MAX (whole numbers), got {text!r}") from None
    if low < 1:
        raise ValueError(f"--replicas: at least 1 replica, got {text!r}")
    if high < low:
        raise ValueError(f"--replicas: MIN:MAX with MIN <= MAX, got {text!r}")
    return ReplicaCount(low, high)


DEFAULT_SCALE_DOWN_DELAY = 60.0


def scale_down_delay(args) -> float:
    """--scale-down-delay, checked against --replicas: ValueError naming it when set without MIN:MAX (it would do
    nothing) or negative."""
    delay = args.scale_down_delay
    if delay is None:
        return DEFAULT_SCALE_DOWN_DELAY
    if not (args.replicas and args.replicas.autoscaled):
        raise ValueError("--scale-down-delay: only with --replicas MIN:MAX (a fixed count never scales down)")
    if delay < 0:
        raise ValueError(f"--scale-down-delay: must be 0 or more seconds, got {delay}")
    return delay


def capacity_plan(args) -> str | None:
    """--capacity-plan as an absolute path (Ray's controller reads it), checked: ValueError naming it without
    --replicas MIN:MAX, or when the file is not a plan."""
    from carpool.server.replicas.autoscaling import read_plan

    if args.capacity_plan is None:
        return None
    if not (args.replicas and args.replicas.autoscaled):
        raise ValueError("--capacity-plan: only with --replicas MIN:MAX (the plan sets a floor for the autoscaler)")
    read_plan(args.capacity_plan)
    return os.path.abspath(args.capacity_plan)


def replicas_arg(text: str) -> ReplicaCount:
    """parse_replicas for argparse, which reports an ArgumentTypeError's own words (`argument --replicas: ...`)."""
    try:
        return parse_replicas(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--replicas: ")) from None
