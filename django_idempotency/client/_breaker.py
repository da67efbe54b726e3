"""Circuit breakers: after repeated failures a host is failed fast for a while, then tried once."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

# The documented logger is the package's, whichever of its modules logs.
logger = logging.getLogger("django_idempotency.client")

State = Literal["closed", "open", "half_open"]
CallResult = Literal["success", "failure", "neither"]

#: The states a circuit can be in, in the order metrics list them.
STATES: Final[tuple[State, ...]] = ("closed", "open", "half_open")


class CircuitOpen(Exception):
    """Raised instead of sending a request to a host whose circuit is open.

    ``host`` names the host; ``retry_in`` is the seconds until the circuit lets a trial request
    through, 0 while a trial is already running. The transports raise it as their library's
    connection error too: ``httpx.TransportError``, ``requests.ConnectionError``.
    """

    def __init__(self, host: str, retry_in: float, **kwargs: Any) -> None:
        self.host = host
        self.retry_in = retry_in
        if retry_in > 0:
            message = f"circuit open for {host}: failing fast, next trial in {retry_in:.3f} s"
        else:
            message = f"circuit open for {host}: failing fast while a trial request runs"
        super().__init__(message, **kwargs)


class Admission(NamedTuple):
    """Whether a request may be sent, and whether it is the trial of a half-open circuit."""

    allowed: bool
    trial: bool = False
    retry_in: float = 0.0


class CircuitBreaker:
    """Fail fast after ``failure_threshold`` failures in a row, all within ``window`` seconds.

    Open, the circuit refuses every request for ``cool_down`` seconds, then lets one trial
    through (half-open): its success closes the circuit, its failure opens it again.
    """

    # Nygard, "Release It!": failures in a row, not a failure rate, so that a busy host with a few
    # errors is never cut off; the window forgets failures too far apart to mean an outage.
    def __init__(
        self,
        host: str = "",
        failure_threshold: int = 10,
        window: float = 30.0,
        cool_down: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_breaker(failure_threshold, window, cool_down)
        self.host = host
        self.failure_threshold = failure_threshold
        self.window = window
        self.cool_down = cool_down
        self.clock = clock
        #: How often the circuit opened, and how many requests it failed fast: for metrics.
        self.opened = 0
        self.rejected = 0
        self._failures: deque[float] = deque(maxlen=failure_threshold)
        self._opened_at: float | None = None
        self._trial_running = False
        self._lock = threading.Lock()

    @property
    def state(self) -> State:
        """Return ``closed``, ``open``, or ``half_open`` once the cool-down is over."""
        with self._lock:
            return self._state(self.clock())

    def _state(self, now: float) -> State:
        if self._opened_at is None:
            return "closed"
        if self._trial_running or now >= self._opened_at + self.cool_down:
            return "half_open"
        return "open"

    def admit(self) -> Admission:
        """Say whether a request may be sent now; the caller must ``record()`` its outcome."""
        with self._lock:
            now = self.clock()
            state = self._state(now)
            if state == "closed":
                return Admission(allowed=True)
            if state == "half_open" and not self._trial_running:
                self._trial_running = True
                trial = True
            else:
                self.rejected += 1
                trial = False
            retry_in = 0.0 if self._opened_at is None else self._opened_at + self.cool_down - now
        if trial:
            self._log("half_open", "circuit half-open for %s: sending one trial request")
            return Admission(allowed=True, trial=True)
        return Admission(allowed=False, retry_in=max(0.0, retry_in))

    def record(self, admission: Admission, outcome: CallResult) -> None:
        """Count the outcome of a request that ``admit()`` let through."""
        with self._lock:
            now = self.clock()
            change: State | None = None
            if admission.trial:
                self._trial_running = False
                # A trial that neither failed nor succeeded (it was cancelled, or its error says
                # nothing of the host) leaves the next request to be the trial.
                if outcome == "success":
                    self._opened_at = None
                    self._failures.clear()
                    change = "closed"
                elif outcome == "failure":
                    self._open(now)
                    change = "open"
            elif self._opened_at is None:
                # Requests let through before the circuit opened say nothing once it has: only
                # the trial decides.
                if outcome == "success":
                    self._failures.clear()
                elif outcome == "failure":
                    self._failures.append(now)
                    while self._failures and self._failures[0] <= now - self.window:
                        self._failures.popleft()
                    if len(self._failures) >= self.failure_threshold:
                        self._open(now)
                        change = "open"
        if change == "open":
            self._log(
                change,
                "circuit open for %s: failing fast for %.3f s",
                self.cool_down,
                level=logging.WARNING,
            )
        elif change == "closed":
            self._log(change, "circuit closed for %s: the trial request succeeded")

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._failures.clear()
        self.opened += 1

    def _log(self, state: State, message: str, *args: Any, level: int = logging.INFO) -> None:
        logger.log(
            level,
            message,
            self.host,
            *args,
            extra={"idempotency_client_host": self.host, "idempotency_client_circuit": state},
        )


class CircuitBreakers:
    """Keep one ``CircuitBreaker`` per host, each created on first use with these settings."""

    def __init__(
        self,
        failure_threshold: int = 10,
        window: float = 30.0,
        cool_down: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_breaker(failure_threshold, window, cool_down)
        self._settings = (failure_threshold, window, cool_down, clock)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()

    def breaker_for(self, host: str) -> CircuitBreaker:
        """Return the breaker of ``host`` (a host name, with ``:port`` if the URL names one)."""
        with self._lock:
            breaker = self._breakers.get(host)
            if breaker is None:
                breaker = self._breakers[host] = CircuitBreaker(host, *self._settings)
                with _BREAKERS_LOCK:
                    _BREAKERS.add(breaker)
            return breaker


def all_breakers() -> Iterator[CircuitBreaker]:
    """Yield every host's breaker that is still in use, for metrics."""
    with _BREAKERS_LOCK:
        breakers = list(_BREAKERS)
    yield from breakers


def _check_breaker(failure_threshold: int, window: float, cool_down: float) -> None:
    if failure_threshold < 1:
        msg = f"failure_threshold must be at least 1, not {failure_threshold!r}"
        raise ValueError(msg)
    if not window > 0 or not cool_down > 0:
        msg = "window and cool_down must be positive"
        raise ValueError(msg)


# Metrics read every breaker, whichever policy made it; weakly held, so that the breakers of a
# policy that is gone leave the metrics with it.
_BREAKERS: weakref.WeakSet[CircuitBreaker] = weakref.WeakSet()
_BREAKERS_LOCK: Final = threading.Lock()

#: The breakers of every policy that does not bring its own.
SHARED_BREAKERS: Final = CircuitBreakers()
