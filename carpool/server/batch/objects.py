"""Stored rows as the JSON objects OpenAI's clients parse: `file`, `batch`, and cursor-paged lists."""

import json


def file_object(row: dict) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(row: dict) -> dict:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "created_at": row["created_at"],
        "in_progress_at": row["in_progress_at"],
        "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"],
        "completed_at": row["completed_at"],
        "failed_at": row["failed_at"],
        "expired_at": row["expired_at"],
        "cancelling_at": row["cancelling_at"],
        "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "usage": {
            "input_tokens": row["input_tokens"],
            "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
            "output_tokens": row["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": row["input_tokens"] + row["output_tokens"],
        },
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def list_object(items: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
