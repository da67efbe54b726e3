"""The views' reconcile hooks, as the adapters declare them, for the sweeper to find.

An adapter registers a view's hook when the view is declared: the view decorator its view, the
DRF mixin each view class, Ninja each operation's function. The sweeper finds a stored key's
route in the URLconf and asks here for the hooks of that route's view. What stands between a URL
pattern's view and the view that was declared is read by Python's and Django's own attributes
(``__wrapped__``, ``view_class``) and, for a framework's own, by a reader that its adapter
registers (DRF's ``as_view()``, Ninja's dispatch of each method to its own operation).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    #: A hook, or the dotted path of one, as the view's option gives it.
    Hook = Callable[..., Any] | str
    #: What a URL pattern's view dispatches to: (its methods, or ``None`` for any; the view).
    Reader = Callable[[Any], Iterable[tuple[Iterable[str] | None, Any]]]

# By the declared view (a function or a class): a view that goes away takes its hook along.
_hooks: weakref.WeakKeyDictionary[Any, Hook] = weakref.WeakKeyDictionary()
_readers: list[Reader] = []


def register(view: Any, hook: Hook | None) -> None:
    """Declare ``view``'s reconcile hook; ``None`` declares that it has none."""
    if hook is None:
        _hooks.pop(view, None)
    else:
        _hooks[view] = hook


def register_reader(reader: Reader) -> None:
    """Tell the registry how a framework's URL pattern views dispatch to declared views."""
    if reader not in _readers:
        _readers.append(reader)


def _behind(callback: Any) -> Iterator[Any]:
    """``callback`` and what it wraps, by ``functools.wraps``, and the class of ``as_view()``."""
    seen: set[int] = set()
    while callback is not None and id(callback) not in seen:
        seen.add(id(callback))
        yield callback
        view_class = getattr(callback, "view_class", None)
        if view_class is not None:
            yield view_class
        callback = getattr(callback, "__wrapped__", None)


def _hook(view: Any) -> Hook | None:
    try:
        return _hooks.get(view)
    except TypeError:  # not weakly referable, so never registered
        return None


def hooks_of(callback: Any) -> dict[str | None, Hook]:
    """The hooks of a URL pattern's view by method; ``None`` for one that serves every method."""
    for view in _behind(callback):
        if (hook := _hook(view)) is not None:
            return {None: hook}
    found: dict[str | None, Hook] = {}
    for reader in _readers:
        for methods, view in reader(callback):
            if (hook := _hook(view)) is not None:
                for method in (None,) if methods is None else methods:
                    found.setdefault(method, hook)
    return found
