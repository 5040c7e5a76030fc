"""Frame rows as JSON values, every number as stored: the one conversion behind every
JSON that mlscope writes from a frame (``mlscope export --format json``, a report's
JSON form).

Not ``DataFrame.to_json``: it writes floats with 10 significant digits (a throughput of
46.781144406638106 comes back as 46.7811444066), so a figure written as JSON would
differ from the stored one and from a recomputation over the raw rows. Here a float is
written as the shortest text that reads back to the same value (``json.dumps``), an
integer whole (a nullable integer column's missing value as null), NaN / None / NaT /
NA as null, and a time as ISO 8601 text with its zone (milliseconds; mlscope stores
times without a zone, in UTC, so those are written with ``+00:00``).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["json_records", "json_value"]


def json_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """``frame``'s rows as JSON-ready objects (column name to :func:`json_value`)."""
    return [{str(k): json_value(v) for k, v in row.items()} for row in frame.to_dict("records")]


def json_value(v: object) -> object:
    """One cell as a JSON value: numpy scalars as Python numbers, NaN / None / NaT / NA
    as null, a time as ISO 8601 text with its zone (UTC where it has none), arrays and
    mappings element by element, bytes as UTF-8 text, anything else that JSON has no
    type for as its text."""
    if v is None or v is pd.NaT or v is pd.NA:
        return None
    if isinstance(v, pd.Timestamp | datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=UTC)
        return v.isoformat(timespec="milliseconds")
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, np.ndarray):
        return [json_value(x) for x in v.tolist()]
    if isinstance(v, list | tuple):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, str | int | float | bool):
        return v
    return str(v)
