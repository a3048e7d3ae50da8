"""Names that moved to another module, still readable from the old one for one release.

A module whose names moved sets ``__getattr__ = moved_names(__name__, {name: new_module})``:
reading such a name warns (``DeprecationWarning``, naming the new path) and returns it from its
new module, imported on first use; any other unknown name is an ``AttributeError`` as usual.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` whose names in ``moved`` now live elsewhere."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {moved[name]}.{name} after 0.4.0; import it from there.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__
