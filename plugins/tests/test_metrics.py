"""The expositions of real daemons and of the client, parsed whole by the
Prometheus project's own OpenMetrics parser (``prometheus_client``), after a
known workload through the Python ``Client``."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, Iterator, List, Tuple

import pytest
from prometheus_client.openmetrics import parser

from conftest import Node, _bin, _die_with_parent
from kvcellar import Client, Geometry, Status

GEO = Geometry(model_hash=0x12, page_size=16, dtype_tag=3, tp_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(addr: str, path: str) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait(what: str, f, limit: float = 20.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = f()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class _Proc:
    """A daemon of ours, stopped by its PID and reaped."""

    def __init__(self, args: List[str], announce: str | None = None):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  preexec_fn=_die_with_parent)
        self.addr = ""
        if announce:
            end = time.monotonic() + 30
            assert self.p.stdout is not None
            while time.monotonic() < end:
                r, _, _ = select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))
                line = self.p.stdout.readline() if r else ""
                if not line:
                    break
                if announce in line:
                    self.addr = line.rsplit(announce, 1)[1].strip()
                    return
            self.stop()
            raise RuntimeError(f"{args[0]} did not start")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.p.wait()
        if self.p.stdout:
            self.p.stdout.close()


@pytest.fixture(scope="module")
def tier() -> Iterator[Dict[str, str]]:
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.path.isfile(etcd_bin):
        pytest.skip("etcd not installed (scripts/deps.sh installs Debian's etcd-server)")
    tmp = tempfile.mkdtemp(prefix="kvcellar-metrics-")
    procs: List[_Proc] = []
    node = None
    try:
        cport, pport = _free_port(), _free_port()
        etcd = f"127.0.0.1:{cport}"
        procs.append(_Proc([etcd_bin, "--data-dir", os.path.join(tmp, "etcd"),
                            "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
                            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                            "--initial-cluster", f"default=http://127.0.0.1:{pport}"]))
        _wait("etcd", lambda: _get(etcd, "/health")[0] == 200 if _port_open(cport) else False)
        mds = _Proc([_bin("kv-mds"), "--listen", "127.0.0.1:0", "--etcd", etcd, "--lease-ttl", "10s"],
                    "kv-mds listening on ")
        procs.append(mds)
        metrics = f"127.0.0.1:{_free_port()}"
        node = Node(tmp, "p1", "64M", ["--metrics-listen", metrics, "--mem-cap", "0", "--mds", mds.addr,
                                       "--group", "py", "--id", "p1", "--advertise", "127.0.0.1:0"]).start()
        _wait("the node in the view", lambda: '"p1"' in _get(mds.addr, "/api/groups")[1])
        yield {"mds": mds.addr, "metrics": metrics, "node": node.addr}
    finally:
        if node is not None:
            node.stop()
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _families(text: str) -> Dict[str, object]:
    """Parses the whole exposition (raises on any malformed line)."""
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(fams: Dict[str, object], family: str, sample: str, **labels: str) -> float:
    for s in fams[family].samples:  # type: ignore[attr-defined]
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"{sample} {labels} not in {family}")


def test_every_exposition_parses_and_shows_the_workload(tier: Dict[str, str]) -> None:
    with Client(mds=tier["mds"], group="py", geometry=GEO) as c:
        for i in range(10):
            assert c.put(f"py-{i}", bytes([i]) * 5000) == Status.OK
        hits = [c.get_bytes(f"py-{i}", 8192) for i in range(7)]
        assert all(h.status == Status.OK for h in hits)
        assert [c.get_bytes(f"gone-{i}", 8192).status for i in range(3)] == [Status.MISS] * 3
        client_text = c.stats()
        counters = c.counters()

    code, text = _get(tier["metrics"], "/metrics")
    assert code == 200
    node = _families(text)
    lab = {"node": "p1", "group": "py"}
    assert _value(node, "kvcellar_requests", "kvcellar_requests_total", op="put", status="ok", **lab) == 10
    assert _value(node, "kvcellar_requests", "kvcellar_requests_total", op="get", status="ok", **lab) == 7
    assert _value(node, "kvcellar_requests", "kvcellar_requests_total", op="get", status="miss", **lab) == 3
    assert _value(node, "kvcellar_hits", "kvcellar_hits_total", tier="disk", **lab) == 7
    assert _value(node, "kvcellar_misses", "kvcellar_misses_total", reason="absent", **lab) == 3
    assert node["kvcellar_request_duration_seconds"].type == "histogram"  # type: ignore[attr-defined]
    assert _value(node, "kvcellar_request_duration_seconds", "kvcellar_request_duration_seconds_count",
                  op="get", **lab) == 10

    code, text = _get(tier["mds"], "/metrics")
    assert code == 200
    mds = _families(text)
    assert _value(mds, "kvmds_group_members", "kvmds_group_members", group="py") == 1
    assert mds["kvmds_etcd_request_duration_seconds"].type == "histogram"  # type: ignore[attr-defined]
    assert _value(mds, "kvmds_views", "kvmds_views_total", kind="poll") >= 1

    client = _families(client_text)
    assert _value(client, "kvclient_ops", "kvclient_ops_total", op="put", status="ok") == 10
    assert _value(client, "kvclient_ops", "kvclient_ops_total", op="get", status="miss") == 3
    assert _value(client, "kvclient_op_duration_seconds", "kvclient_op_duration_seconds_count", op="get") == 10
    assert _value(client, "kvclient_mds_up", "kvclient_mds_up") == 1
    assert counters['kvclient_ops_total{op="put",status="ok"}'] == 10

    groups = json.loads(_get(tier["mds"], "/api/groups")[1])
    member = groups["groups"][0]["members"][0]
    assert member["metrics_addr"] == tier["metrics"]
    assert _get(tier["metrics"], "/healthz") == (200, "ok\n")
