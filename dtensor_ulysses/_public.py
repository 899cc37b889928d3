"""Re-exporting a subpackage's public names lazily: the one helper every ``__init__`` uses.

A subpackage's ``__init__`` writes its public names once, as the imports of its
``if TYPE_CHECKING:`` block (so type checkers and IDEs see every name with its real type), and
calls :func:`lazy_exports`, which reads that block back from the file (:func:`public_names`) and
derives the rest: ``__all__``, and the map of each name to the module that defines it. A name is
imported on first use (PEP 562), so importing one module of a subpackage
(``dtensor_ulysses.memory.tiling``) does not import its siblings (``offload`` and
``torch.distributed``): the layering test follows real import-time dependencies only. On first
use, a function's or class's ``__module__`` becomes the subpackage (``repr``, docs and pickling
say ``dtensor_ulysses.debug.CommCounter``, not the file it lives in), as
``torch.distributed.tensor.debug`` does. Only ``__init__`` files re-export.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["lazy_exports", "public_names"]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def public_names(package: str) -> dict[str, str]:
    """``{name: submodule}`` read from the ``if TYPE_CHECKING:`` block of ``package``'s
    ``__init__``: each ``from package.sub import name`` there is one public name, in file order.

    Raises:
        ValueError: the ``__init__`` has no such block (a facade must list its names there).
    """
    init = importlib.import_module(package).__file__
    assert init is not None
    tree = ast.parse(Path(init).read_text(encoding="utf-8"))
    blocks = [node for node in tree.body if _is_type_checking(node)]
    if not blocks:
        raise ValueError(f"{package}/__init__.py lists no public names in an `if TYPE_CHECKING:`")
    out: dict[str, str] = {}
    prefix = package + "."
    for block in blocks:
        for stmt in getattr(block, "body", []):
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(prefix):
                assert stmt.module is not None
                for alias in stmt.names:
                    out[alias.asname or alias.name] = stmt.module[len(prefix) :]
    return out


def lazy_exports(
    package: str,
    exports: dict[str, str] | None = None,
    *,
    own_module: bool = True,
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public name ``n`` lives in the
    submodule ``exports[n]`` (relative to ``package``; default: :func:`public_names`).

    Args:
        package: the package's ``__name__``.
        exports: the name -> submodule map; ``None`` reads it from the ``TYPE_CHECKING`` block.
        own_module: give a function or class the package as ``__module__`` (the root package,
            whose names belong to subpackages, passes ``False``).
    """
    exports = public_names(package) if exports is None else exports
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        module = getattr(value, "__module__", None)
        if (
            own_module
            and callable(value)
            and isinstance(module, str)
            and module.startswith(package + ".")
        ):
            value.__module__ = package
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__, list(exports)
