"""Fixtures: real kv-server processes on loopback, started per test module.

Binaries come from ``KVCELLAR_BIN_DIR`` (default: the workspace's
``target/debug``, built by ``cargo build --workspace``). The library is the
package's own when it is installed (``pip install ./plugins``); from a source
tree, ``KVCELLAR_LIB`` defaults to the workspace build.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BIN_DIR = os.environ.get("KVCELLAR_BIN_DIR") or os.path.join(ROOT, "target", "debug")

#: The plugins' deadlines for tests about what is stored, not when (ms
#: each): a loaded CI machine can take more than the defaults. The tests of
#: deadlines set their own, or name the defaults.
GENEROUS_DEADLINES = {"lookup_deadline_ms": 3000, "load_deadline_ms": 3000, "save_deadline_ms": 3000}

# From a source tree (not installed), use the workspace's library.
if not os.environ.get("KVCELLAR_LIB"):
    import kvcellar._native as _n

    if not any(os.path.isfile(p) for p in _n.candidates()[:-2]):
        os.environ["KVCELLAR_LIB"] = os.path.join(BIN_DIR, "libkvclient.so")


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, even by a crash
    that skips every fixture's teardown (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _bin(name: str) -> str:
    p = os.path.join(BIN_DIR, name)
    if not os.path.isfile(p):
        pytest.skip(f"{p} not built: run `cargo build --workspace`")
    return p


class Node:
    """One kv-server process (ours: stopped by its PID, always reaped)."""

    def __init__(self, workdir: str, name: str, cap: str = "256M", extra: Optional[List[str]] = None):
        self.name = name
        self.dir = os.path.join(workdir, name)
        self.cap = cap
        self.extra = extra or []
        self.proc: Optional[subprocess.Popen] = None
        self.addr = ""
        self.listen = "127.0.0.1:0"

    def start(self, deadline_s: float = 30.0) -> "Node":
        args = [_bin("kv-server"), "--listen", self.listen, "--dir", self.dir, "--cap", self.cap,
                "--log-level", "warn", "--drain-secs", "0", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=_die_with_parent)
        end = time.monotonic() + deadline_s
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not r:
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            if "listening on " in line:
                self.addr = line.rsplit("listening on ", 1)[1].strip()
                # Restart on the same address: keys keep their owner.
                self.listen = self.addr
                return self
        self.stop()
        raise RuntimeError(f"kv-server {self.name} did not start")

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc:
            try:
                self.proc.wait(timeout=20)
            finally:
                if self.proc.stdout:
                    self.proc.stdout.close()
            self.proc = None


def _wait_stopped(pid: int, deadline_s: float = 10.0) -> None:
    """Returns once every thread of ``pid`` is stopped (/proc state T): a
    SIGSTOP is delivered when each thread next runs, and a thread already
    on a CPU may answer a request meanwhile."""
    end = time.monotonic() + deadline_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # the thread exited
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"pid {pid} not stopped {deadline_s} s after SIGSTOP: thread states {states}")
        time.sleep(0.002)


@contextlib.contextmanager
def stalled(node: "Node"):
    """The node SIGSTOPped (it accepts connections, the kernel queues its
    bytes, it answers nothing) for the block, entered once every thread
    of it has stopped; SIGCONT whatever happens."""
    assert node.proc is not None and node.proc.poll() is None
    node.proc.send_signal(signal.SIGSTOP)
    try:
        _wait_stopped(node.proc.pid)
        yield node
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)


class Cluster:
    def __init__(self, n: int, cap: str = "256M"):
        self.tmp = tempfile.mkdtemp(prefix="kvcellar-py-")
        self.nodes = [Node(self.tmp, f"n{i}", cap) for i in range(n)]
        try:
            for node in self.nodes:
                node.start()
        except Exception:
            self.stop()
            raise

    @property
    def members(self) -> str:
        return ",".join(f"{n.name}={n.addr}" for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(3)
    yield c
    c.stop()


class TokenNode:
    """A node of a group with an auth token, and that token's file (plus a
    file holding a wrong one)."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="kvcellar-py-auth-")
        self.token_file = os.path.join(self.tmp, "token")
        self.wrong_file = os.path.join(self.tmp, "wrong")
        for path, text in ((self.token_file, "py-group-token\n"), (self.wrong_file, "another-token")):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o600)
        self.node = Node(self.tmp, "t0", extra=["--auth-token-file", self.token_file]).start()

    @property
    def members(self) -> str:
        return f"t0={self.node.addr}"

    def stop(self) -> None:
        self.node.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def token_node():
    t = TokenNode()
    yield t
    t.stop()


@pytest.fixture()
def clean_env(monkeypatch):
    for v in ("KVCELLAR_MDS", "KVCELLAR_GROUP", "KVCELLAR_MEMBERS", "KVCELLAR_AUTH_TOKEN_FILE", "KVCELLAR_OPTIONS"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def fake_hub(monkeypatch, root: str, model: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """A Hugging Face hub cache under `root` holding `model` at `commit`
    (its refs/main), as an engine that downloaded the model leaves it;
    HF_HUB_CACHE names it. Returns the commit."""
    ref = os.path.join(root, "models--" + model.replace("/", "--"), "refs")
    os.makedirs(ref, exist_ok=True)
    with open(os.path.join(ref, "main"), "w") as f:
        f.write(commit)
    monkeypatch.setenv("HF_HUB_CACHE", root)
    return commit


def pytest_report_header(config):
    """Which engine classes this run uses (real, or stand-ins)."""
    from kvcellar import _lmcache_api, _sglang_api

    mode = {True: "REAL", False: "stand-in"}
    return f"kvcellar: SGLang classes {mode[_sglang_api.REAL]}, LMCache classes {mode[_lmcache_api.REAL]}"


sys.path.insert(0, HERE)
