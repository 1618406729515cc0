"""What both engine plugins do with a failure of the store: the engine sees
a miss (it recomputes the prefill, or skips the write), never an exception.

A cache tier that raises into the engine's scheduler can take a serving
process down for what is, to the engine, only a cache miss. So every store
step the plugins run goes through :class:`Misses`: a closed client is a
quiet miss; any other failure is logged at ERROR the first time its cause
(the step and the exception type) is seen, then at DEBUG, so a node that
stays down does not flood the engine's log.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Set, TypeVar

from kvcellar.client import ClosedError

T = TypeVar("T")


class Misses:
    """Turns a plugin's failing store steps into misses, logged once per cause."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._seen: Set[str] = set()

    def error(self, what: str, e: BaseException) -> None:
        """Logs a failure: ERROR the first time for its cause, DEBUG after."""
        cause = f"{what}: {type(e).__name__}"
        with self._lock:
            first = cause not in self._seen
            self._seen.add(cause)
        (self._log.error if first else self._log.debug)("kvcellar: %s failed: %s", what, e)

    def run(self, what: str, default: T, fn: Callable[[], T]) -> T:
        """`fn()`, or `default` when it fails (logged) or the client is closed."""
        try:
            return fn()
        except ClosedError:
            return default
        except Exception as e:  # noqa: BLE001 - a failure is a miss for the engine
            self.error(what, e)
            return default


__all__ = ["Misses"]

