"""The one "a failure is a miss" rule both plugins share (kvcellar._misses)."""

import logging

from kvcellar._misses import Misses
from kvcellar.client import ClosedError


def test_a_failure_is_the_default_logged_once_per_cause(caplog):
    m = Misses(logging.getLogger("kvcellar.test"))

    def boom():
        raise OSError("node gone")

    with caplog.at_level(logging.DEBUG, logger="kvcellar.test"):
        assert m.run("batch get", [None, None], boom) == [None, None]
        assert m.run("batch get", [None, None], boom) == [None, None]
        assert m.run("batch set", [False], boom) == [False]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG]
    # One ERROR per cause (step and exception type), the repeat at DEBUG.
    assert [r.getMessage() for r in errors] == [
        "kvcellar: batch get failed: node gone",
        "kvcellar: batch set failed: node gone",
    ]
    assert len(debugs) == 1


def test_a_closed_client_is_a_quiet_miss_and_success_passes_through(caplog):
    m = Misses(logging.getLogger("kvcellar.test"))

    def closed():
        raise ClosedError("closed")

    with caplog.at_level(logging.DEBUG, logger="kvcellar.test"):
        assert m.run("exists", False, closed) is False
        assert m.run("exists", False, lambda: True) is True
    assert not caplog.records


def test_both_plugins_use_it():
    import kvcellar.hicache as h
    import kvcellar.lmcache as lm

    assert h.Misses is Misses and lm.Misses is Misses
