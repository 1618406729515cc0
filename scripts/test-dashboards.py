#!/usr/bin/env python3
"""Browser test of the dashboards: a real etcd, kv-mds and two
kv-server nodes on loopback (started by kv-local) under load (kvctl bench), then headless Chromium
renders the node's and the MDS's page; the rendered text is checked (hit
rate, disk rows, ring members, each member's health) and a screenshot of each
is saved. Run by scripts/test-dashboards.sh (which installs Chromium).

Usage: scripts/test-dashboards.py OUT_DIR   (binaries from KVCELLAR_BIN_DIR,
default target/debug)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BIN = os.environ.get("KVCELLAR_BIN_DIR") or os.path.join(ROOT, "target", "debug")
procs: list[subprocess.Popen] = []
WORK = "."  # the daemons' working directory: disk dirs are given relative to it


def http(addr: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
        return r.read().decode()


def wait(what: str, f, limit: float = 30.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            v = f()
        except OSError:
            v = None
        if v:
            return v
        time.sleep(0.2)
    raise SystemExit(f"dashboards: timed out waiting for {what}")


def start(args: list[str]) -> None:
    """Starts a load generator (ended with the rest at the end)."""
    procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=WORK))


def start_cluster(args: list[str]) -> list[str]:
    """Starts kv-local and returns the lines it printed up to "ready" (it
    bounds its own start: if the cluster does not come up, it exits)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(os.path.join(WORK, "kv-local.log"), "w"),
                         stdin=subprocess.DEVNULL, text=True)
    procs.append(p)
    lines: list[str] = []
    for line in p.stdout:
        if line.strip() == "ready":
            return lines
        lines.append(line.strip())
    raise SystemExit("dashboards: kv-local did not bring the cluster up (see kv-local.log)")


def chromium(url: str, png: str | None, width: int, height: int) -> str:
    """The rendered DOM (with png: also a screenshot), after the page's
    timers ran for a few (virtual) seconds."""
    prof = tempfile.mkdtemp(prefix="kvc-chromium-")
    try:
        args = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={prof}",
                "--virtual-time-budget=5000", f"--window-size={width},{height}"]
        if png:
            subprocess.run(args + [f"--screenshot={png}", url], check=True, timeout=90,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        dom = subprocess.run(args + ["--dump-dom", url], check=True, timeout=90, capture_output=True, text=True)
        return dom.stdout
    finally:
        shutil.rmtree(prof, ignore_errors=True)


def text_of(dom: str) -> str:
    t = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", t))


def check(ok: bool, what: str, failures: list[str]) -> None:
    print(("  ok   " if ok else "  FAIL ") + what)
    if not ok:
        failures.append(what)


def main() -> int:
    out_dir = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "dashboards"))
    os.makedirs(out_dir, exist_ok=True)
    global WORK
    tmp = tempfile.mkdtemp(prefix="kvc-dash-")
    WORK = tmp
    failures: list[str] = []
    try:
        # etcd, one kv-mds and two nodes, by kv-local (the one loopback-cluster starter).
        lines = start_cluster([f"{BIN}/kv-local", "--work", tmp, "--nodes", "2", "--disks", "2", "--mds", "1",
                               "--group", "demo", "--id-prefix", "gpu-node-", "--metrics", "--",
                               "--cap", "48M", "--mem-cap", "8M", "--log-level", "warn", "--drain-secs", "0"])
        mds = next(l.split()[1] for l in lines if l.startswith("mds "))
        metrics = [w.split("=", 1)[1] for l in lines if l.startswith("node ") for w in l.split() if w.startswith("metrics=")]
        # Load: puts that overflow the caps (evictions), gets of a hot set.
        kv = [f"{BIN}/kvctl", "bench", "--mds", mds, "--group", "demo", "--no-raw", "--threads", "2"]
        start(kv + ["--op", "put", "--size", "256K", "--duration", "60"])
        start(kv + ["--op", "get", "--size", "64K", "--keys", "300", "--duration", "60"])
        start(kv + ["--op", "batch-exist", "--batch", "32", "--keys", "300", "--duration", "60"])
        # Wait for the node to hold 10 samples (20 s) of that load.
        wait("20 s of history", lambda: len(json.loads(http(metrics[0], "/api/history"))["samples"]) >= 10, 60)

        print("== node dashboard")
        node_png = os.path.join(out_dir, "dashboard-node.png")
        dom = text_of(chromium(f"http://{metrics[0]}/", node_png, 1300, 1050))
        hit = re.search(r"Hit rate ([0-9.]+) %", dom)
        check(hit is not None and 0 < float(hit.group(1)) <= 100, f"hit rate shown ({hit and hit.group(0)})", failures)
        check("gpu-node-1" in dom and "group demo" in dom, "node id and group in the header", failures)
        check("serving" in dom, "health badge says serving", failures)
        check(all(f"disk{i} " in dom for i in (0, 1)) and dom.count("in service") >= 3, "a row per disk, in service",
              failures)
        check("memory tier" in dom and "disk tier" in dom, "a row per tier", failures)
        check(re.search(r"Tenants \(last interval\).*default [0-9.]+ [KMG]iB \(no quota\) \d+ [0-9.]+ [0-9.]+ %", dom)
              is not None, "the tenants' table: the default tenant's holding and hit rate", failures)
        check(re.search(r"get [0-9.]+ [0-9.]+ (µs|ms)", dom) is not None, "latency by op: get p50 shown", failures)
        check(re.search(r"Read [0-9.]+ MB/s", dom) is not None, "read throughput shown", failures)
        check(os.path.getsize(node_png) > 20_000, "screenshot saved", failures)

        print("== kv-mds dashboard")
        mds_png = os.path.join(out_dir, "dashboard-mds.png")
        dom = text_of(chromium(f"http://{mds}/", mds_png, 1300, 420))
        check("group demo" in dom and "epoch" in dom, "the group with its epoch", failures)
        check("gpu-node-1" in dom and "gpu-node-2" in dom, "both ring members listed", failures)
        check(dom.count("serving") >= 2, "each member's health read from its own page", failures)
        check(re.search(r"[0-9.]+ % [0-9.]+ %|\d+\.\d %", dom) is not None, "shares shown", failures)
        check("etcd reachable" in dom, "etcd state shown", failures)
        check(re.search(r"tenants summed over the members.*default [0-9.]+ [KMG]iB \(no quota\) \d+ [0-9.]+ [0-9.]+ %", dom)
              is not None, "the group's tenants summed over the members", failures)
        check(re.search(r"read balance [0-9.]+x the mean gets \(busiest: gpu-node-[12]\)", dom) is not None,
              "the read balance shown", failures)
        check(os.path.getsize(mds_png) > 10_000, "screenshot saved", failures)
        print(f"screenshots: {node_png} {mds_png}")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"dashboards: {8 + 6 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
