"""The base of the package's middleware: each serves sync and async requests alike."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.http import HttpRequest


class SyncAndAsyncMiddleware(ABC):
    """Django's hybrid middleware: under ASGI it runs on the event loop, without a thread hop.

    ``is_async`` tells ``__call__`` which of the two the next handler is.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    @abstractmethod
    def __call__(self, request: HttpRequest) -> Any:
        """The response, or (``is_async``) an awaitable of it."""
