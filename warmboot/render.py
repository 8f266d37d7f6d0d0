"""Plain aligned columns for the operator views (kubectl's style: no borders, upper-case headers).

A cell is never cut. A view declares its columns in the order shown and says which
ones give way when the table is wider than the terminal: each `Column` has a `drop`
rank (0: always shown; the highest rank goes first) and may name a `narrow` column to
show in its place (a count instead of a list, say). `-o wide` shows every column,
including the `wide` ones, whatever the width. `render_fields` lays out one object
as `KEY  value` lines, wrapping a long value at spaces (never inside a word).
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

GAP = "  "  # between columns


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Any], str]
    right: bool = False  # numbers are right-aligned
    drop: int = 0  # 0: always shown; when the table does not fit, the highest rank gives way first
    wide: bool = False  # shown only with -o wide
    narrow: "Column | None" = None  # shown instead of this one when it gives way
    about: str = ""  # what a narrow column shows, for the note on what gave way ("as a count")


@dataclass
class Rendered:
    text: str
    left_out: list[str] = field(default_factory=list)  # what gave way to fit the width
    width: int = 0  # of the widest line

    def footnote(self, width: int | None) -> str:
        if not self.left_out:
            return ""
        note = f"(to fit {width} columns: {', '.join(self.left_out)}; -o wide shows every column)"
        return "\n".join(textwrap.wrap(note, width or len(note), break_long_words=False, break_on_hyphens=False))


def terminal_width() -> int | None:
    """$COLUMNS, else the terminal's width; None when the output is not a terminal (nothing gives way)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def _cells(columns: Sequence[Column], rows: Sequence[Any]) -> list[list[str]]:
    return [[c.header for c in columns]] + [[c.value(row) for c in columns] for row in rows]


def _line_width(columns: Sequence[Column], table: list[list[str]]) -> int:
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return sum(widths) + len(GAP) * (len(columns) - 1)


def fit(columns: Sequence[Column], rows: Sequence[Any], width: int | None, wide: bool = False
        ) -> tuple[list[Column], list[str]]:
    """The columns to show within `width`, and what gave way (in the order it did)."""
    shown = [c for c in columns if wide or not c.wide]
    left_out: list[str] = []
    if wide or width is None:
        return shown, left_out
    full = list(shown)
    given: list[Column] = []  # the columns of `full` that gave way, in the order they did
    while _line_width(shown, _cells(shown, rows)) > width:
        candidates = [c for c in full if c.drop > 0 and c not in given]
        if not candidates:
            break  # what must stay is wider than the terminal: the lines run on, cells stay whole
        given.append(max(candidates, key=lambda c: (c.drop, full.index(c))))
        shown = _layout(full, given)
    # a column that gave way early may fit again once later ones have: the most important first, and
    # none after one that does not (a less important one shown whole where a more important one is left
    # out read as rows without their class: `workers` at 80 columns kept RESTORABLE and left out CLASS)
    for column in reversed(list(given)):
        trial = [c for c in given if c is not column]
        if _line_width(_layout(full, trial), _cells(_layout(full, trial), rows)) > width:
            break
        given = trial
    return _layout(full, given), [_given_way(c) for c in given]


def _layout(full: list[Column], given: list[Column]) -> list[Column]:
    """`full` with each column of `given` replaced by its narrow form, or left out."""
    return [c.narrow if c in given and c.narrow else c for c in full if c not in given or c.narrow]


def _given_way(column: Column) -> str:
    return f"{column.header} {column.narrow.about}" if column.narrow else column.header


def key_values(pairs: Mapping[str, str]) -> str:
    """Labels or selectors as every view writes them in a cell: `key=value` by key, comma-separated
    (as kubectl's --show-labels), `-` for none. The same worker's labels read alike in `workers -o
    wide` and `worker show`, and an actor's selectors alike (a trial found ", " in one, "," in the other)."""
    return ",".join(f"{k}={v}" for k, v in sorted(pairs.items())) or "-"


def render_table(columns: Sequence[Column], rows: Sequence[Any], width: int | None = None,
                 wide: bool = False) -> Rendered:
    shown, left_out = fit(columns, rows, width, wide)
    table = _cells(shown, rows)
    widths = [max(len(r[i]) for r in table) for i in range(len(shown))]
    lines = []
    for cells in table:
        parts = [cell.rjust(w) if c.right else cell.ljust(w) for cell, w, c in zip(cells, widths, shown)]
        lines.append(GAP.join(parts).rstrip())
    return Rendered("\n".join(lines), left_out, max((len(line) for line in lines), default=0))


def cell_columns(columns: Sequence[Column]) -> tuple[list[Column], Callable[[Any], tuple[str, ...]]]:
    """`columns` as columns that read a row's cells by position, and the function that makes those cells
    of a row (every column's value, and its narrow form's): a long listing keeps each row's few strings
    until it is laid out, not the row (`actor list --limit 0` held 50,000 rows as dicts: 370 MB)."""
    values: list[Callable[[Any], str]] = []

    def reading(column: Column) -> Column:
        values.append(column.value)
        at = operator.itemgetter(len(values) - 1)
        narrow = reading(column.narrow) if column.narrow is not None else None
        return dataclasses.replace(column, value=at, narrow=narrow)

    read = [reading(c) for c in columns]
    return read, lambda row: tuple(value(row) for value in values)


class JsonList:
    """A JSON array written an element at a time, exactly as `json.dumps(elements, indent=2)` writes it
    whole, through `write`: a listing of any length is printed a page at a time, its memory a page's
    (`actor list -o json` of 50,000 actors held them all, and their 61 MB of text: 890 MB)."""

    def __init__(self, write: Callable[[str], Any]):
        self.write = write
        self.count = 0

    def add(self, element: Any) -> None:
        text = textwrap.indent(json.dumps(element, indent=2), "  ")
        self.write(("[\n" if self.count == 0 else ",\n") + text)
        self.count += 1

    def close(self) -> None:
        self.write("\n]\n" if self.count else "[]\n")


def render_fields(pairs: Sequence[tuple[str, str]], width: int | None = None) -> str:
    """`KEY   value` lines; a value longer than the width continues on lines of its own under itself."""
    if not pairs:
        return ""
    key_width = max(len(k) for k, _ in pairs)
    indent = " " * (key_width + len(GAP))
    room = None if width is None else max(width - len(indent), 20)
    lines = []
    for key, value in pairs:
        head = key.ljust(key_width) + GAP
        if room is None or len(value) <= room:
            lines.append((head + value).rstrip())
            continue
        wrapped = textwrap.wrap(value, room, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(head + wrapped[0])
        lines.extend(indent + more for more in wrapped[1:])
    return "\n".join(lines)
