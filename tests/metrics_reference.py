"""The keys `docs/reference/metrics.md` lists: the tests that train check that every key they log is there."""

import functools
import re
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md"


@functools.cache
def _documented() -> list[re.Pattern[str]]:
    """Each listed key (a table row's first cell) as a pattern: a `<placeholder>` stands for any name."""
    keys = re.findall(r"^\| `([^`]+)` \|", REFERENCE.read_text(), re.MULTILINE)
    return [re.compile(re.sub(r"<[a-z]+>", "[A-Za-z0-9_]+", re.escape(key))) for key in keys]


def assert_documented(records: list[dict[str, float]]) -> None:
    """Every key of the logged `records` (per-step metrics) matches a key of the metrics reference."""
    logged = {key for record in records for key in record}
    missing = sorted(key for key in logged if not any(p.fullmatch(key) for p in _documented()))
    assert not missing, f"logged but not in docs/reference/metrics.md: {missing}"
