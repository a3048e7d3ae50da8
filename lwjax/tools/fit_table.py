"""Tables that fit the console: each column says whether it folds and when it may be left out.

A :class:`FitTable` collects rows and lays them out when ``rich`` prints it, at the console's
width. Columns that must stay (a parameter's path, Muon or AdamW, the numbers a table is
about) are never left out; columns of lesser value carry a ``drop`` rank and are left out,
highest rank first, while the table's narrowest form is wider than the console. Long text
(paths, labels, reasons) folds onto more lines instead of widening the table; every other
column keeps its values whole. The narrowest form of a table of columns with widths
:math:`w_c` (a folding column counts at most ``FOLD_WIDTH``) is

.. math::

  W = \\sum_c (w_c + 2) + (C + 1)

characters: each of the :math:`C` columns is padded by one space on either side, and
:math:`C + 1` rules separate them. ``rich`` is imported only when the table is drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FOLD_WIDTH = 16  # the narrowest a folding column is counted at


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a :class:`FitTable`.

    Attributes:
      name: The header.
      text: Left-aligned text; otherwise a right-aligned number.
      fold: Long values fold onto more lines rather than widen the table.
      drop: 0: always shown; else left out when the table does not fit, highest rank first.
    """

    name: str
    text: bool = False
    fold: bool = False
    drop: int = 0


class FitTable:
    """Rows of a table whose columns are chosen, and folded, for the console's width.

    Args:
      title: Printed above the table (wrapped to its width).
      columns: The :class:`Column` of each cell of a row, in order.
      caption: Printed below the table, or ``None``.
    """

    def __init__(self, title: str, columns: Sequence[Column], caption: str | None = None):
        self.title, self.columns, self.caption = title, tuple(columns), caption
        self.rows: list[tuple[tuple[str, ...], str | None, bool]] = []

    def add_row(self, *cells: str, style: str | None = None, end_section: bool = False) -> None:
        """Add a row; missing trailing cells stay empty. ``cells`` may hold rich markup."""
        self.rows.append((cells, style, end_section))

    def end_section(self) -> None:
        """Draw a rule under the last row."""
        cells, style, _ = self.rows[-1]
        self.rows[-1] = (cells, style, True)

    def _widest(self, index: int) -> int:
        """The widest cell (or header) of column ``index``, in characters, markup left out."""
        from rich.text import Text

        cells = [row[index] for row, _, _ in self.rows if index < len(row)]
        return max([Text.from_markup(c).cell_len for c in cells] + [len(self.columns[index].name)])

    def shown(self, width: int) -> list[int]:
        """Indices of the columns shown on a console ``width`` characters wide."""
        needed = {}
        for i, column in enumerate(self.columns):
            widest = self._widest(i)
            needed[i] = (min(widest, FOLD_WIDTH) if column.fold else widest) + 3  # pad, rule
        shown = set(needed)
        droppable = sorted((c.drop, i) for i, c in enumerate(self.columns) if c.drop)
        while droppable and sum(needed[i] for i in shown) + 1 > width:
            shown.discard(droppable.pop()[1])
        return sorted(shown)

    def fold_widths(self, shown: Sequence[int], width: int) -> dict[int, int]:
        """Widths of the shown folding columns when the table is wider than ``width``: the
        earlier column whole while the later ones keep ``FOLD_WIDTH`` (a path before a reason)."""
        widest = {i: self._widest(i) for i in shown}
        if sum(widest[i] + 3 for i in shown) + 1 <= width:
            return {}
        folding = [i for i in shown if self.columns[i].fold]
        left = width - 1 - sum(widest[i] + 3 for i in shown if i not in folding) - 3 * len(folding)
        widths = {}
        for k, i in enumerate(folding):
            later = len(folding) - k - 1
            widths[i] = max(FOLD_WIDTH, min(widest[i], left - FOLD_WIDTH * later))
            left -= widths[i]
        return widths

    def __rich_console__(self, console, options):
        from rich.table import Table

        shown = self.shown(options.max_width)
        widths = self.fold_widths(shown, options.max_width)
        table = Table(
            title=self.title,
            title_justify="left",
            title_style="bold",
            caption=self.caption,
            caption_justify="left",
        )
        for i in shown:
            column = self.columns[i]
            table.add_column(
                column.name,
                justify="left" if column.text else "right",
                no_wrap=not column.fold,
                overflow="fold" if column.fold else "ellipsis",
                width=widths.get(i),
            )
        for cells, style, end_section in self.rows:
            cells = [cells[i] if i < len(cells) else "" for i in shown]
            table.add_row(*cells, style=style, end_section=end_section)
        yield table
