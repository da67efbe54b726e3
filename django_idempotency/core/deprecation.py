"""Names kept at an old import path for a while, under the deprecation policy of docs/api.md.

A deprecated path still works, and warns each time it is used with a ``DeprecationWarning``
subclass that names the release that removes it and the path to import from instead.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


class RemovedInDjangoIdempotency12Warning(DeprecationWarning):
    """What goes in django-idempotency 1.2."""


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers each of ``names`` from its new home, with a warning.

    ``names`` maps a name that ``module`` no longer defines to the module that is its home now.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            msg = f"module {module!r} has no attribute {name!r}"
            raise AttributeError(msg)
        home = names[name]
        warnings.warn(
            f"{module}.{name} is deprecated and goes in django-idempotency 1.2: import it from "
            f"{home}",
            RemovedInDjangoIdempotency12Warning,
            # The code that used the name: warn() passes over the import system's frames.
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
