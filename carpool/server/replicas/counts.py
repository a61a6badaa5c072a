"""`--replicas N` (a fixed count) or `--replicas MIN:MAX` (Ray Serve's autoscaler keeps each model between the
two): parsed without Ray, so a bad value fails before anything starts."""

import argparse
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


def replicas_arg(text: str) -> ReplicaCount:
    """parse_replicas for argparse, which reports an ArgumentTypeError's own words (`argument --replicas: ...`)."""
    try:
        return parse_replicas(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--replicas: ")) from None
