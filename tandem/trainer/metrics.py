"""Metrics and completions written as JSON lines, flushed each step so they can be plotted live."""

import json
import math
from pathlib import Path


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None plots as a gap
    return value


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a")

    def write(self, record: dict) -> None:
        self.fh.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()
