"""Column names that mean the same thing in the CSV files twinserve reads (a trace's
`arrival_time`, a `--real` run's `arrival_s`), so either reader takes either name."""
from __future__ import annotations

SAME_COLUMNS = (("arrival_time", "arrival_s"),)


def _same_cell(first: str, second: str) -> bool:
    try:
        return float(first) == float(second)
    except ValueError:
        return first.strip() == second.strip()


def unify_columns(header: list[str], rows: list[list[str]], line_numbers: list[int],
                  wanted: tuple[str, ...], where: str) -> list[str]:
    """`header` with aliases of the `wanted` columns renamed; where a file has both names, every
    row's two cells must agree."""
    header = list(header)
    for names in SAME_COLUMNS:
        name = next((name for name in names if name in wanted), None)
        others = [other for other in names if other != name and other in header]
        if name is None or not others:
            continue
        if name not in header:
            header[header.index(others[0])] = name
            others = others[1:]
        for other in others:
            kept, alias = header.index(name), header.index(other)
            for row, line in zip(rows, line_numbers):
                first = row[kept] if kept < len(row) else ""
                second = row[alias] if alias < len(row) else ""
                if not _same_cell(first, second):
                    raise ValueError(f"{where}: line {line}: columns {name} and {other} are "
                                     f"the same column under two names and disagree ({first!r} "
                                     f"against {second!r}); keep one")
            header[alias] = f"{other} (read as {name})"
    return header
