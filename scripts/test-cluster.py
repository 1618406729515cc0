#!/usr/bin/env python3
"""The container cluster test: separate hosts that stop, die or are cut off.

Brings up packaging/compose/docker-compose.yml under a project of its own
(etcd x3, kv-mds x2, kv-server x3 on a private network; scripts/cluster-up.sh)
on free 127.0.0.1 ports, then, with clients in containers on that network
(tests/cluster/workload.py, every byte of every page checked):

  1. `kvctl ring` from a client container lists 3 nodes;
  2. pages written and read back, every byte compared;
  3. `docker stop` of a node: time until the ring drops it, then its keys
     miss fast (worst get latency after the removal);
  4. the stopped node started again: its pages are served again (kept on its
     volume, found under its name although its address may change);
  5. `docker network disconnect` of a node (a partition): worst get latency
     (bounded by the client's I/O timeout), fast misses once it is out of the
     ring, and after `docker network connect` it is back with its pages;
  6. one kv-mds and one etcd member stopped: the cluster keeps serving
     (gets and puts); the views mds2 gives during the outage are recorded
     (a node whose lease mds2 could not take over in time drops out and
     registers again);
  7. a node moved to a new address under the same name (disconnected and
     reconnected with another IP within the lease): no epoch change, and the
     clients find it again by resolving its name on reconnect;
  8. `docker kill` of a node (no deregistration): removal within the lease
     TTL; started again, it serves its pages.

Prints each figure and "wrong pages: 0" (or fails), and writes them as JSON
to target/cluster-report.json for docs/RELIABILITY.md.
Usage: scripts/test-cluster.py      (needs the kvcellar image: scripts/package.sh)
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE = os.path.join(ROOT, "packaging", "compose", "docker-compose.yml")
WORKLOAD = os.path.join(ROOT, "tests", "cluster", "workload.py")
PROJECT = f"kvctest{os.getpid()}"
GROUP = "cluster"
TTL_S = 6
IO_TIMEOUT_MS = 1000  # workload.py's io_timeout_ms
PAGES, SIZE = 240, 256 * 1024

report = {}
failures = []


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def free_subnet() -> str:
    """A /24 that no Docker network here uses (the cluster's addresses are
    given by hand in one step)."""
    used = set()
    ids = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True).stdout.split()
    if ids:
        out = subprocess.run(["docker", "network", "inspect", "-f", "{{range .IPAM.Config}}{{.Subnet}} {{end}}", *ids],
                             capture_output=True, text=True).stdout
        used = {s.rsplit(".", 1)[0] for s in out.split()}
    for third in range(200, 255):
        prefix = f"172.31.{third}"
        if prefix not in used:
            return f"{prefix}.0/24"
    raise RuntimeError("no free 172.31.x.0/24 subnet for the test network")


SUBNET = free_subnet()
PORTS = {k: str(free_port()) for k in ["KVC_MDS1_PORT", "KVC_MDS2_PORT", "KVC_NODE1_METRICS", "KVC_NODE2_METRICS", "KVC_NODE3_METRICS"]}
ENV = dict(os.environ, KVC_PROJECT=PROJECT, KVC_GROUP=GROUP, KVC_LEASE_TTL=f"{TTL_S}s", KVC_SUBNET=SUBNET, **PORTS)


def sh(*args, check=True, timeout=180) -> str:
    r = subprocess.run(list(args), env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def compose(*args, check=True) -> str:
    return sh("docker-compose", "-p", PROJECT, "-f", COMPOSE, *args, check=check)


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def client_cmd(*args) -> list:
    return [
        "docker", "run", "--rm", "--network", f"{PROJECT}_cluster",
        "-e", "KVCELLAR_MDS=mds1:7480,mds2:7480", "-e", f"KVCELLAR_GROUP={GROUP}",
        "-v", f"{WORKLOAD}:/work/workload.py:ro", "kvcellar:latest", *map(str, args),
    ]


def workload(*args) -> dict:
    out = sh(*client_cmd("python3", "/work/workload.py", *map(str, args)), timeout=300)
    return json.loads(out.strip().splitlines()[-1])["summary"]


def view(mds_port_key="KVC_MDS1_PORT") -> list:
    url = f"http://127.0.0.1:{PORTS[mds_port_key]}/v1/groups/{GROUP}/view"
    with urllib.request.urlopen(url, timeout=3) as r:
        return sorted(m["id"] for m in json.load(r)["members"])


def view_epoch(mds_port_key="KVC_MDS1_PORT") -> int:
    url = f"http://127.0.0.1:{PORTS[mds_port_key]}/v1/groups/{GROUP}/view"
    with urllib.request.urlopen(url, timeout=3) as r:
        return int(json.load(r)["epoch"])


def view_record(mds_port_key="KVC_MDS1_PORT") -> tuple:
    """(epoch, member ids) of one view read."""
    url = f"http://127.0.0.1:{PORTS[mds_port_key]}/v1/groups/{GROUP}/view"
    with urllib.request.urlopen(url, timeout=3) as r:
        v = json.load(r)
    return int(v["epoch"]), ",".join(sorted(m["id"] for m in v["members"]))


class ViewLog:
    """Samples the view every 0.25 s in the background: each change of
    epoch, with the time and the members, to say what moved it."""

    def __init__(self):
        self.changes = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        last = None
        while not self.stop.is_set():
            try:
                rec = view_record()
            except Exception as e:  # noqa: BLE001 - a 503 or a timeout is part of the record
                rec = (None, f"error: {e}")
            if rec != last:
                self.changes.append((round(time.time(), 2), rec[0], rec[1]))
                last = rec
            time.sleep(0.25)

    def finish(self) -> list:
        self.stop.set()
        self.t.join(10)
        return self.changes


def wait_for_steady_epoch(quiet: float, seconds: float) -> tuple:
    """Waits until the view's epoch has not moved for `quiet` seconds (a
    restarted kv-mds or etcd member settling); returns (seconds it took,
    epochs it moved). Fails after `seconds`."""
    t0 = time.time()
    first = last = view_epoch()
    since = time.time()
    while time.time() - t0 < seconds:
        time.sleep(0.25)
        try:
            e = view_epoch()
        except Exception:  # noqa: BLE001 - a 503 while etcd elects a leader: not steady
            since = time.time()
            continue
        if e != last:
            last, since = e, time.time()
        elif time.time() - since >= quiet:
            return time.time() - t0, last - first
    raise SystemExit(f"FAIL: the epoch did not settle within {seconds} s (moved {last - first})")


def wait_for(what: str, pred, seconds: float) -> float:
    """Polls pred every 0.1 s; returns the seconds it took, fails after `seconds`."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            if pred():
                return time.time() - t0
        except Exception:  # noqa: BLE001 - a daemon not answering yet is the point of waiting
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {seconds:.0f} s waiting for {what}")


class Watch:
    """A client container getting every page round-robin, one JSON line per get."""

    def __init__(self, seconds: float):
        self.p = subprocess.Popen(
            client_cmd("python3", "/work/workload.py", "watch", "pg", PAGES, SIZE, seconds),
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.ops = []
        self.summary = None
        self.started = threading.Event()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()
        if not self.started.wait(60):
            raise RuntimeError("the watching client did not start")

    def _read(self):
        for line in self.p.stdout:
            d = json.loads(line)
            if isinstance(d, dict):
                self.summary = d["summary"]
            else:
                self.ops.append(d)
                self.started.set()

    def finish(self) -> dict:
        self.p.wait(timeout=120)
        self.t.join(10)
        if self.summary is None:
            raise RuntimeError(f"watching client failed: {self.p.stderr.read()[-2000:]}")
        return self.summary

    def worst_ms(self, start: float = 0, end: float = 1e18) -> float:
        return max((op[1] for op in self.ops if start <= op[0] < end), default=0.0)

    def slow(self, start: float, end: float, ms: float) -> int:
        return sum(1 for op in self.ops if start <= op[0] < end and op[1] > ms)


checks = [0]


def fault_until_removed(node: str, seconds: float, *cmd: str):
    """Starts a watching client, runs the fault command `cmd` 2 s later, and
    waits until `node` leaves the ring: (watch, its summary, fault time,
    removal time)."""
    w = Watch(seconds)
    time.sleep(2)
    t_fault = time.time()
    sh(*cmd)
    t_out = t_fault + wait_for(f"{node} out of the ring", lambda: node not in view(), 60)
    return w, w.finish(), t_fault, t_out


def check(name: str, cond: bool, detail: str):
    checks[0] += 1
    print(f"{'ok' if cond else 'FAIL'}: {name}: {detail}", flush=True)
    if not cond:
        failures.append(name)


def main() -> int:
    t_all = time.time()
    wrong = 0
    try:
        up = subprocess.run(["bash", os.path.join(ROOT, "scripts", "cluster-up.sh")], env=ENV, timeout=600,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if up.returncode != 0:
            # Say why: cluster-up's own words and the containers' states (the
            # handler below adds their logs and takes down what did start).
            print(up.stdout[-4000:] + compose("ps", check=False), flush=True)
            raise RuntimeError(f"scripts/cluster-up.sh: exit {up.returncode}")
        # 1. The ring, as a client on the cluster network sees it.
        ring = json.loads(sh(*client_cmd("kvctl", "--json", "ring")))
        ids = sorted(m["id"] for m in ring["members"])
        check("ring from a client container", ids == ["node1", "node2", "node3"], f"members {ids}, epoch {ring['epoch']}")

        # 2. Pages written and verified byte for byte.
        f = workload("fill", "pg", PAGES, SIZE)
        v = workload("verify", "pg", PAGES, SIZE)
        wrong += v["wrong"]
        report["pages_verified"] = v["hits"]
        check("write and verify", f["ok"] == PAGES and v["hits"] == PAGES and v["wrong"] == 0,
              f"{f['ok']} put, {v['hits']} read back, {v['wrong']} wrong, {v['verified_bytes'] >> 20} MiB compared")

        # 3. docker stop: graceful, the node deregisters.
        w, s, t_stop, t_removed = fault_until_removed("node3", 16, "docker", "stop", "-t", "30", container("node3"))
        wrong += s["wrong"]
        # The client polls kv-mds every 200 ms: allow a poll and a bit.
        after = t_removed + 1.0
        report["stop_removal_s"] = round(t_removed - t_stop, 2)
        report["stop_worst_ms"] = round(w.worst_ms(t_stop), 1)
        report["stop_worst_after_removal_ms"] = round(w.worst_ms(after), 1)
        check("docker stop removes the node", t_removed - t_stop <= TTL_S,
              f"out of the ring {t_removed - t_stop:.2f} s after docker stop (lease TTL {TTL_S} s)")
        # As after a partition (below): a get that waited on the stopped
        # node would take a handoff ask's 500 ms or the 1 s I/O timeout;
        # 250 ms leaves room for one stall of this 2-core machine (a run
        # saw one get of 120 ms among 14,524) without hiding that.
        check("its keys then miss fast", w.worst_ms(after) < 250,
              f"worst get after removal {w.worst_ms(after):.1f} ms over {sum(1 for o in w.ops if o[0] >= after)} gets "
              f"({w.slow(after, 1e18, 100)} over 100 ms); "
              f"worst during the stop {w.worst_ms(t_stop):.1f} ms; {s['wrong']} wrong")

        # 4. Start it again: its pages come back from its volume.
        sh("docker", "start", container("node3"))
        back = wait_for("node3 back in the ring", lambda: "node3" in view(), 60)
        v = workload("verify", "pg", PAGES, SIZE)
        wrong += v["wrong"]
        report["restart_rejoin_s"] = round(back, 2)
        report["restart_hits"] = v["hits"]
        check("a restarted node keeps its pages", v["hits"] == PAGES and v["wrong"] == 0,
              f"back in the ring {back:.2f} s after docker start; {v['hits']}/{PAGES} pages hit, {v['wrong']} wrong")

        # 5. A partition: the node is cut off the network, then reconnected.
        net = f"{PROJECT}_cluster"
        w, s, t_cut, t_out = fault_until_removed("node2", 20, "docker", "network", "disconnect", net, container("node2"))
        wrong += s["wrong"]
        after = t_out + 1.0
        report["partition_removal_s"] = round(t_out - t_cut, 2)
        report["partition_worst_ms"] = round(w.worst_ms(t_cut), 1)
        report["partition_slow_gets"] = w.slow(t_cut, 1e18, 200)
        report["partition_worst_after_removal_ms"] = round(w.worst_ms(after), 1)
        check("partition: worst latency bounded by the I/O timeout", w.worst_ms(t_cut) <= IO_TIMEOUT_MS + 500,
              f"worst get {w.worst_ms(t_cut):.0f} ms (io_timeout_ms={IO_TIMEOUT_MS}); "
              f"{w.slow(t_cut, 1e18, 200)} gets over 200 ms; out of the ring after {t_out - t_cut:.2f} s")
        # A get that waited on the cut-off node would take a handoff ask's
        # 500 ms or the 1 s I/O timeout; 250 ms leaves room for one stall of
        # this 2-core machine (a run once saw 128 ms) without hiding that.
        check("partition: then fast misses", w.worst_ms(after) < 250,
              f"worst get after removal {w.worst_ms(after):.1f} ms; {s['wrong']} wrong")
        # Compose gave the container its service name as an alias on the
        # network; a plain `network connect` would not restore it.
        sh("docker", "network", "connect", "--alias", "node2", net, container("node2"))
        back = wait_for("node2 back in the ring", lambda: "node2" in view(), 60)
        v = workload("verify", "pg", PAGES, SIZE)
        wrong += v["wrong"]
        report["partition_rejoin_s"] = round(back, 2)
        check("reconnected node serves its pages", v["hits"] == PAGES and v["wrong"] == 0,
              f"back in the ring {back:.2f} s after docker network connect; {v['hits']}/{PAGES} hit, not served: {v['not_served']}")

        # 6. One kv-mds and one etcd member down: still serving. The ring
        # is sampled through the outage (a whole lease period): nodes whose
        # heartbeats went to mds1 must be taken over by mds2 before their
        # leases run out, while etcd may be electing a new leader.
        t_down = time.time()
        sh("docker", "stop", "-t", "10", container("mds1"), container("etcd1"))
        seen = set()
        while time.time() - t_down < TTL_S + 2:
            try:
                seen.add(tuple(view("KVC_MDS2_PORT")))
            except Exception:  # noqa: BLE001 - a 503 while etcd elects a leader is part of what is measured
                seen.add(("503",))
            time.sleep(0.25)
        back3 = wait_for("three nodes via mds2", lambda: view("KVC_MDS2_PORT") == ["node1", "node2", "node3"], TTL_S * 2)
        v = workload("verify", "pg", PAGES, SIZE)
        f = workload("fill", "more", 30, SIZE)
        wrong += v["wrong"]
        churn = sorted(",".join(r) for r in seen if r != ("node1", "node2", "node3"))
        report["mds_etcd_down_views_other_than_3"] = churn
        report["mds_etcd_down_hits"] = v["hits"]
        check("one kv-mds and one etcd member down: still serving", v["hits"] == PAGES and f["ok"] == 30,
              f"{v['hits']}/{PAGES} hit, {v['wrong']} wrong; {f['ok']}/30 new puts; not served: {v['not_served']}; "
              f"views via mds2 other than the 3 nodes during the outage: {churn or 'none'} "
              f"(3 nodes {back3:.1f} s after the sampling)")
        sh("docker", "start", container("etcd1"), container("mds1"))
        wait_for("mds1 answering", lambda: len(view()) == 3, 60)

        # 7. The same name, a new address, no epoch change (counted from
        # an epoch that has settled after the restarts of step 6: quiet for
        # a whole lease period, so a lease left over from the restarts has
        # run out before the move rather than during it; with half a
        # period, runs saw the epoch move 15 -> 22 during the move).
        settle_s, settle_moved = wait_for_steady_epoch(TTL_S + 1, 90)
        views = ViewLog()
        report["move_settle_s"] = round(settle_s, 1)
        report["move_settle_epochs"] = settle_moved
        ip_of = lambda c: sh("docker", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{net}").IPAddress}}}}', c).strip()  # noqa: E731
        old_ip = ip_of(container("node1"))
        new_ip = SUBNET.rsplit(".", 1)[0] + ".200"
        w = Watch(14)
        time.sleep(2)
        t_move = time.time()
        sh("docker", "network", "disconnect", net, container("node1"))
        sh("docker", "network", "connect", "--alias", "node1", "--ip", new_ip, net, container("node1"))
        s = w.finish()
        view_changes = views.finish()
        wrong += s["wrong"]
        settled = t_move + 5.0  # an I/O timeout (1 s) and a cool-down (2 s), with margin
        late = [op for op in w.ops if op[0] >= settled]
        late_hits = sum(1 for op in late if op[2] == 0)
        report["move_epoch_same"] = s["epoch"] == s["epoch_end"]
        report["move_worst_ms"] = round(w.worst_ms(t_move), 1)
        report["move_hits_after_5s"] = f"{late_hits}/{len(late)}"
        check("a node at a new address under its name is found again without an epoch change",
              ip_of(container("node1")) == new_ip and s["epoch"] == s["epoch_end"] and late and late_hits == len(late) and s["wrong"] == 0,
              f"{old_ip} -> {new_ip}; epoch {s['epoch']} -> {s['epoch_end']}; worst get {w.worst_ms(t_move):.0f} ms; "
              f"from 5 s after the move {late_hits}/{len(late)} gets hit; {s['wrong']} wrong; "
              f"views (time from the move, epoch, members): "
              f"{[(round(t - t_move, 2), e, m) for t, e, m in view_changes]}")

        # 8. docker kill: no deregistration, the lease runs out.
        sh("docker", "kill", container("node1"))
        gone = wait_for("node1 out of the ring", lambda: "node1" not in view(), 60)
        report["kill_removal_s"] = round(gone, 2)
        check("docker kill: removed within the lease TTL", gone <= TTL_S + 1.5,
              f"out of the ring {gone:.2f} s after docker kill (lease TTL {TTL_S} s)")
        # ... and started again: acknowledged pages were on media (kill -9 of
        # the container, not of the host, so nothing unsynced is at stake).
        sh("docker", "start", container("node1"))
        back = wait_for("node1 back in the ring", lambda: "node1" in view(), 60)
        v = workload("verify", "pg", PAGES, SIZE)
        wrong += v["wrong"]
        report["kill_restart_hits"] = v["hits"]
        check("a killed node restarted serves its pages", v["hits"] == PAGES and v["wrong"] == 0,
              f"back in the ring {back:.2f} s after docker start; {v['hits']}/{PAGES} hit, not served: {v['not_served']}")
    except Exception as e:  # noqa: BLE001 - report, then tear down
        failures.append(str(e))
        print(f"FAIL: {e}", flush=True)
        print(compose("logs", "--tail", "30", check=False)[-6000:])
    finally:
        compose("down", "--volumes", "--timeout", "10", check=False)
    report["wrong_pages"] = wrong
    report["seconds"] = round(time.time() - t_all, 1)
    check("wrong pages", wrong == 0, f"{wrong} wrong pages in all")
    os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
    with open(os.path.join(ROOT, "target", "cluster-report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print(json.dumps(report))
    print(f"cluster: {checks[0] - len(failures)} passed, {len(failures)} failed in {report['seconds']} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
