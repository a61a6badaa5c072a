"""What a batch may be, and where batches live on disk."""

import os
from dataclasses import dataclass
from pathlib import Path

from carpool.models.loader import cache_dir

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # the only window OpenAI offers; seconds


@dataclass(frozen=True)
class BatchLimits:
    """OpenAI's hosted limits by default: 50,000 requests or 200 MB per input file."""

    max_file_bytes: int = 200 * 2**20
    max_requests: int = 50_000
    # A file that is wrong everywhere would otherwise produce a batch object as big as the file itself.
    max_reported_errors: int = 1000


def default_batch_dir() -> Path:
    """`CARPOOL_BATCH_DIR`, else batches/ in carpool's cache folder (`CARPOOL_CACHE_DIR`, ~/.cache/carpool)."""
    override = os.environ.get("CARPOOL_BATCH_DIR")
    return Path(override) if override else cache_dir() / "batches"
