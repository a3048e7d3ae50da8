"""Python files outside the package (docs scripts, workers, fuzz harnesses), imported by path."""

import importlib.util
import pathlib


def imported(path: pathlib.Path):
    """The module that the file at ``path`` defines, named by its stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
