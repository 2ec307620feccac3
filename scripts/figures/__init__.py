"""The figures the docs quote, each with the committed JSON it comes from (scripts/docs_figures.py).

One module per topic defines FIGURES (name -> Figure); a figure's name starts with its topic. Figure.render
turns the loaded JSON into the text the docs quote, so a figure's derivation (a median over repeats, a
ratio of two rows) is code beside its source, not arithmetic done by hand.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


class FigureError(Exception):
    pass


@dataclass(frozen=True)
class Figure:
    # a committed JSON, relative to the repository; or several, when a figure combines runs (render then
    # gets their contents in that order)
    source: str | tuple[str, ...]
    render: Callable[[Any], str]  # the JSON -> the text quoted

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else self.source

    def value(self, root: Path) -> str:
        sources = self.sources
        for source in sources:
            if not (root / source).exists():
                raise FigureError(f"its source {source} is missing (commit it, or take the figure out)")
        loaded = [_load(root / source) for source in sources]
        return self.render(loaded[0] if isinstance(self.source, str) else loaded)


@cache
def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def all_figures() -> dict[str, Figure]:
    """Every topic module's FIGURES, merged (a name defined twice is an error)."""
    figures: dict[str, Figure] = {}
    for module in pkgutil.iter_modules(__path__):
        mine = importlib.import_module(f"{__name__}.{module.name}").FIGURES
        twice = figures.keys() & mine.keys()
        if twice:
            raise FigureError(f"figures defined twice: {sorted(twice)}")
        figures.update(mine)
    return figures
