"""Where a bench's results land."""

import json
from pathlib import Path


def write_report(path: str, report) -> None:
    """A bench's JSON report at `path`, its folders created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
