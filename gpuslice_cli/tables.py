"""Tables as kubectl prints them: upper-case headers, columns left-aligned and three spaces apart,
no trailing blanks, ``<none>`` for an empty cell."""

from __future__ import annotations

from collections.abc import Sequence

NONE = "<none>"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """One table; every cell is ``str()``-ed, an empty one shows ``<none>``."""
    cells = [[h.upper() for h in headers]] + [[str(c) if str(c) != "" else NONE for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        lines.append("   ".join(parts).rstrip())
    return "\n".join(lines)
