"""What a batch may be."""

from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # the only window OpenAI offers; seconds


@dataclass(frozen=True)
class BatchLimits:
    """OpenAI's hosted limits by default: 50,000 requests or 200 MB per input file."""

    max_file_bytes: int = 200 * 2**20
    max_requests: int = 50_000
    # A file that is wrong everywhere would otherwise produce a batch object as big as the file itself.
    max_reported_errors: int = 1000
