"""What the engine needs to know about one view: its options, each defaulting to a setting.

``ViewOptions`` is the one list of per-view options: the decorator takes them as keyword
arguments, and the DRF mixin reads each one from its ``idempotency_<name>`` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from django_idempotency.conf import Mode, checked, idempotency_settings

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import timedelta
    from typing import Unpack

    from django.http import HttpResponseBase

    Recover = Callable[..., HttpResponseBase | None]

__all__ = ["Policy", "ViewOptions"]


class ViewOptions(TypedDict, total=False):
    """The options a view may set; one left out (or ``None``) follows its ``IDEMPOTENCY`` key.

    The header's name and the replay cache are the deployment's, not a view's: clients, the
    schema and the cache's capacity are planned for the whole API.
    """

    required: bool
    methods: Iterable[str]
    ttl: timedelta | float
    wait_timeout: float
    scope_function: Callable[[Any, str], str] | str
    fingerprint_headers: Iterable[str]
    retryable_status_codes: Iterable[int]
    invalid_request_status_codes: Iterable[int]
    mode: Mode
    lease_timeout: timedelta | float
    # Lease mode: what the sweeper asks about this view's keys whose lease ran out (see
    # django_idempotency.reconcile); found through the URL pattern the key records.
    reconcile: Callable[[Any], Any] | str


# The IDEMPOTENCY key behind each option: the option's name in capitals, but for one.
SETTING_OF = {
    name: "KEY_REQUIRED" if name == "required" else name.upper()
    for name in ViewOptions.__optional_keys__
}


def check_option_names(options: Iterable[str]) -> None:
    """Refuse an option that does not exist, as a misspelt keyword argument would be."""
    if unknown := set(options) - set(SETTING_OF):
        msg = f"Unknown idempotency options: {', '.join(sorted(unknown))}."
        raise TypeError(msg)


@dataclass(frozen=True)
class Policy:
    """Everything the engine needs to know about one view, resolved at request time."""

    header: str
    required: bool
    methods: frozenset[str]
    ttl: timedelta
    wait_timeout: float
    scope_function: Callable[[Any, str], str]
    fingerprint_headers: tuple[str, ...]
    retryable_status_codes: frozenset[int]
    invalid_request_status_codes: frozenset[int]
    mode: Mode
    lease_timeout: timedelta
    cache: str | None
    # Lease mode: called as recover(request, key=..., attempt=...) before a key whose earlier
    # request did not finish runs again; a response means "the effect already happened".
    recover: Recover | None = None

    @classmethod
    def from_settings(
        cls, recover: Recover | None = None, **options: Unpack[ViewOptions]
    ) -> Policy:
        """Build a policy from ``IDEMPOTENCY`` and the view's ``options``."""
        check_option_names(options)
        values: dict[str, Any] = {}
        for name, setting in SETTING_OF.items():
            if name == "reconcile":
                continue  # the sweeper's, which finds it on the view (see core.sweeper)
            value = options.get(name)
            if value is None:
                values[name] = idempotency_settings.get(setting)
            else:
                values[name] = checked(setting, value, f"The view's {name} option")
        return cls(
            header=idempotency_settings.HEADER,
            cache=idempotency_settings.CACHE,
            recover=recover,
            **values,
        )

    def stores(self, status: int) -> bool:
        """Whether a response with this status is stored: 2xx, 3xx and a business 4xx.

        Not a 5xx, a status that invites a retry, or one that rejects the request as invalid:
        the view's writes are rolled back, and a retry with the key runs the view again.
        """
        return (
            status < 500
            and status not in self.retryable_status_codes
            and status not in self.invalid_request_status_codes
        )
