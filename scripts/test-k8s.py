#!/usr/bin/env python3
"""The Kubernetes manifests (packaging/k8s/) tested without a cluster.

Run by scripts/test-k8s.sh, which provides a venv with PyYAML and
kubernetes-validate. Each check prints "ok: ..." or "FAIL: ..."; the last
line is "k8s: N passed, M failed" (scripts/test.sh totals it).

1. Every overlay renders with `kubectl kustomize`.
2. Every rendered object validates, strictly (no unknown field), against
   the bundled schemas of each Kubernetes version in SUPPORTED; kinds with
   no schema there (the ServiceMonitor CRD) are listed as unchecked and
   checked structurally below instead.
3. What the daemons depend on, in each overlay's output: the image and its
   tag, ports, probes, the stop grace against drain_secs, every disk of
   kv-server.toml mounted from a hostPath, the TOML's keys known to
   kv-server, the token Secret's mode and the pod's ids against the
   Dockerfile's user, kv-mds's Service, budget and etcd endpoints, the
   NetworkPolicies' ports, each component's own settings, and kv-mds's
   --max-long-polls, --max-conns and memory limit recomputed from the fleet
   its Deployment says it is sized for (mds_need, docs/DEPLOY.md).
4. start-node.sh, as rendered, run with sh over a stand-in kv-server that
   prints its arguments: the id rule for node names up to 253 characters,
   and an IPv6 pod address.
5. With Docker and the image kvcellar:VERSION: the rendered pods' commands
   run as containers on a Docker network this test makes (kv-mds as its
   Deployment runs it, under the name kv-mds; the init container; then
   kv-server as the DaemonSet runs it, as uid 900 with a read-only root):
   the node joins under the id derived from a long node name, serves a
   page, its token file draws no warning, SIGTERM turns /readyz 503 while
   /livez stays 200, and a second signal ends the drain.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request

import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "packaging", "k8s")
OVERLAYS = sorted(os.listdir(os.path.join(K8S, "overlays")))
SUPPORTED = [f"1.{m}.0" for m in range(29, 38)]
NO_SCHEMA = {"ServiceMonitor"}
ID_RULE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

passed = failed = 0


def check(what, fn):
    global passed, failed
    try:
        extra = fn()
        passed += 1
        print(f"ok: {what}{': ' + extra if extra else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
        failed += 1
        print(f"FAIL: {what}: {type(e).__name__}: {e}", flush=True)


def version():
    for line in open(os.path.join(ROOT, "Cargo.toml")):
        m = re.match(r'version = "(.*)"', line)
        if m:
            return m.group(1)
    raise RuntimeError("no version in Cargo.toml")


def image_ids():
    """The uid and gid the Dockerfile gives the kvcellar user."""
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    uid = re.search(r"useradd [^\n]*--uid (\d+)", text.replace("\\\n", " "))
    gid = re.search(r"groupadd [^\n]*--gid (\d+)", text)
    assert uid and gid, "the Dockerfile makes no kvcellar user with fixed ids"
    return int(uid.group(1)), int(gid.group(1))


def file_config_keys():
    """The keys kv-server's TOML accepts (FileConfig in server/src/config.rs)."""
    src = open(os.path.join(ROOT, "server", "src", "config.rs")).read()
    body = re.search(r"pub struct FileConfig \{(.*?)\n\}", src, re.S)
    assert body, "no FileConfig in server/src/config.rs"
    return set(re.findall(r"pub (\w+):", body.group(1)))


RENDERED = {}


def render(overlay):
    if overlay not in RENDERED:
        out = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, "overlays", overlay)],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip())
        RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return RENDERED[overlay]


def one(objs, kind, name):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def configmap(objs, prefix):
    """The generated ConfigMap `prefix-<hash>`."""
    found = [o for o in objs if o["kind"] == "ConfigMap" and re.fullmatch(prefix + r"-[a-z0-9]{10}", o["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} ConfigMaps {prefix}-<hash>"
    return found[0]


def container(pod_spec, name, init=False):
    cs = pod_spec.get("initContainers" if init else "containers", [])
    found = [c for c in cs if c["name"] == name]
    assert len(found) == 1, f"no {'init ' if init else ''}container {name}"
    return found[0]


def size(text):
    """Bytes of a size as kv-server (4G, 256M) or Kubernetes (6Gi) writes it."""
    m = re.fullmatch(r"(\d+)([KMGT])(i?)", text)
    assert m, f"size {text!r}"
    return int(m.group(1)) << (10 * "KMGT".index(m.group(2)) + 10)


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# --- 1 and 2: render and validate ------------------------------------------


def check_schemas(overlay):
    objs = render(overlay)
    unchecked = set()
    for v in SUPPORTED:
        for o in objs:
            if o["kind"] in NO_SCHEMA:
                unchecked.add(o["kind"])
                continue
            try:
                kubernetes_validate.validate(o, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{o['kind']}/{o['metadata']['name']} on {v}: {str(e).splitlines()[0]}") from None
    kinds = sorted({o["kind"] for o in objs} - unchecked)
    note = f"{len(objs)} objects ({', '.join(kinds)}) valid on Kubernetes {SUPPORTED[0]}-{SUPPORTED[-1]}"
    if unchecked:
        note += f"; no schema, checked structurally: {', '.join(sorted(unchecked))}"
    return note


# --- 3: what the daemons depend on -----------------------------------------


def check_node(overlay):
    objs = render(overlay)
    ds = one(objs, "DaemonSet", "kv-server")
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    c = container(pod, "kv-server")
    # The image: this release's tag.
    image = c["image"]
    assert image.split("/")[-1] == f"kvcellar:{version()}", f"image {image}, not this release's tag"
    # One node at a time.
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}, spec["updateStrategy"]
    assert pod["nodeSelector"] == {"kvcellar.io/cache": "true"}, pod["nodeSelector"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"data": 7700, "metrics": 9700}, ports
    # Probes: readiness on /readyz (unready while draining or with no disk),
    # liveness and startup on /livez (a draining node is not restarted).
    probe = lambda k: (c[k]["httpGet"]["path"], c[k]["httpGet"]["port"])  # noqa: E731
    assert probe("readinessProbe") == ("/readyz", "metrics"), probe("readinessProbe")
    assert probe("livenessProbe") == ("/livez", "metrics"), probe("livenessProbe")
    assert probe("startupProbe") == ("/livez", "metrics"), probe("startupProbe")
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup >= 1800, f"startup allowance {startup} s: a crash recovery of a large store takes minutes"
    # The configuration the pod mounts.
    cm = configmap(objs, "kv-server")
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    toml = tomllib.loads(cm["data"]["kv-server.toml"])
    unknown = set(toml) - file_config_keys()
    assert not unknown, f"kv-server.toml keys kv-server does not know: {sorted(unknown)}"
    for k in ("listen", "metrics_listen", "advertise", "id"):
        assert k not in toml, f"{k} comes from the pod (start-node.sh), not the file"
    assert "start-node.sh" in cm["data"] and c["command"] == ["sh", "/etc/kvcellar/start-node.sh"], c["command"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/kvcellar/kv-server.toml"]["subPath"] == "kv-server.toml"
    assert mounts["/etc/kvcellar/start-node.sh"]["subPath"] == "start-node.sh"
    # Stop: the drain, then closing and the checkpoint.
    drain = toml.get("drain_secs", 30)
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= drain + 30, f"terminationGracePeriodSeconds {grace} < drain_secs {drain} + 30"
    # Every disk of the TOML is a hostPath volume mounted in the node and
    # in the init container that hands it to the kvcellar user.
    init = container(pod, "disk-owner", init=True)
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    dirs = [d.split(":")[0] for d in toml["dirs"]]
    assert dirs, "no disk"
    for d in dirs:
        assert d in mounts, f"disk {d} is not mounted in kv-server"
        vol = vols[mounts[d]["name"]]
        assert "hostPath" in vol, f"disk {d} is not a hostPath volume: {vol}"
        assert init_mounts.get(d) == mounts[d]["name"], f"disk {d} is not handed over by the init container"
    data_mounts = [p for p in mounts if p.startswith("/data/")]
    assert sorted(data_mounts) == sorted(dirs), f"mounted {data_mounts}, listed {dirs}"
    # The token: a Secret file readable by the pod's group only, the ids
    # the image's user has (so the daemons' own mode check stays quiet).
    uid, gid = image_ids()
    sc = pod["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"], sc["runAsNonRoot"]) == (uid, gid, gid, True), sc
    tok = vols["token"]["secret"]
    assert tok["secretName"] == "kvcellar-token" and tok["defaultMode"] == 0o440, tok
    token_dir = next(p for p, m in mounts.items() if m["name"] == "token")
    assert os.path.dirname(toml["auth_token_file"]) == token_dir, (toml["auth_token_file"], token_dir)
    csc = c["securityContext"]
    assert csc["readOnlyRootFilesystem"] and not csc["allowPrivilegeEscalation"], csc
    # Memory: the tier is reserved at start; with the buffer pool (256 MiB),
    # the put bodies in flight and 1 GiB for the index and the heap, inside
    # the container's limit.
    limit = size(c["resources"]["limits"]["memory"])
    need = size(toml.get("mem_cap", "0")) + (256 << 20) + size(toml.get("max_inflight", "1G")) + (1 << 30)
    assert limit >= need, f"memory limit {limit >> 20} MiB < {need >> 20} MiB (mem_cap + pool + max_inflight + 1 GiB)"
    # The node reaches kv-mds through its Service.
    assert toml["mds"] == "kv-mds:7480", toml["mds"]
    ann = spec["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"]) == ("true", "9700"), ann
    return f"{image}, {len(dirs)} disk(s), grace {grace} s for a {drain} s drain"


# kv-mds's memory, measured by tests/src/bin/kv-mds-size.rs (docs/DEPLOY.md,
# "Sizing the membership tier"), rounded up: a base, then per member of the
# group, per long-poll it may hold (at the peak, when a change answers every
# waiter at once) and per other connection it may keep.
MDS_BASE = 16 << 20
MDS_PER_MEMBER = 6 << 10
MDS_PER_LONG_POLL = 80 << 10
MDS_PER_CONN = 64 << 10


def mds_need(nodes, engines, replicas):
    """--max-long-polls, --max-conns and the memory one replica needs for a
    fleet, the others holding the share of one replica that is down."""
    serving = max(replicas - 1, 1)
    long_polls = -(-engines * 5 // (4 * serving))  # 25 % room
    conns = long_polls + -(-nodes * 5 // (4 * serving)) + 256
    memory = MDS_BASE + nodes * MDS_PER_MEMBER + long_polls * MDS_PER_LONG_POLL + (conns - long_polls) * MDS_PER_CONN
    return long_polls, conns, memory


def check_mds_sizing(dep, c, cm):
    sized = dict(kv.split("=") for kv in dep["metadata"]["annotations"]["kvcellar.io/sized-for"].split())
    nodes, engines = int(sized["nodes"]), int(sized["engines"])
    replicas = dep["spec"]["replicas"]
    long_polls, conns, memory = mds_need(nodes, engines, replicas)
    # The caps come through the kv-mds ConfigMap ($(VAR) from its keys).
    env = {e["name"]: cm["data"][e["valueFrom"]["configMapKeyRef"]["key"]]
           for e in c["env"] if "configMapKeyRef" in e.get("valueFrom", {})}
    args = [expand(a, env) for a in c["args"]]
    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    have_polls, have_conns = int(flags.get("max-long-polls", 2048)), int(flags.get("max-conns", 4096))
    limit = size(c["resources"]["limits"]["memory"])
    assert have_polls >= long_polls, f"--max-long-polls {have_polls} < {long_polls} for {engines} engines on {replicas} replicas"
    assert have_conns >= conns, f"--max-conns {have_conns} < {conns} (long-polls + {nodes} nodes' connections + room)"
    # Memory for the caps set, not only for the fleet: a replica at its caps must not be OOM-killed.
    need = MDS_BASE + nodes * MDS_PER_MEMBER + have_polls * MDS_PER_LONG_POLL + (have_conns - have_polls) * MDS_PER_CONN
    assert limit >= need, f"memory limit {limit >> 20} MiB < {need >> 20} MiB for --max-long-polls {have_polls}, --max-conns {have_conns}, {nodes} nodes"
    assert have_conns >= have_polls, "--max-conns below --max-long-polls"
    return f"sized for {nodes} nodes, {engines} engines: {replicas} replicas, {have_polls} long-polls, {have_conns} conns, {limit >> 20} MiB (needs {memory >> 20})"


def check_sizing_rule():
    """The sizing check itself: caps or a limit below the need fail."""
    objs = render("example")
    dep = json.loads(json.dumps(one(objs, "Deployment", "kv-mds")))
    cm = configmap(objs, "kv-mds")
    c = container(dep["spec"]["template"]["spec"], "kv-mds")
    check_mds_sizing(dep, c, cm)
    refused = []
    for what, change in [("memory", lambda: c["resources"]["limits"].update(memory="64Mi")),
                         ("fleet", lambda: dep["metadata"]["annotations"].update({"kvcellar.io/sized-for": "nodes=100 engines=5000"})),
                         ("caps", lambda: cm["data"].update({"max-long-polls": "4000", "max-conns": "4500"}))]:
        saved = json.dumps([dep, cm])
        change()
        try:
            check_mds_sizing(dep, c, cm)
        except AssertionError as e:
            refused.append(f"{what}: {e}")
        d, m = json.loads(saved)
        dep.clear(), dep.update(d), cm.clear(), cm.update(m)
        c = container(dep["spec"]["template"]["spec"], "kv-mds")
    assert len(refused) == 3, f"a sizing below the need passed: {refused}"
    return "; ".join(r.split(" for ")[0] for r in refused)


def check_mds(overlay):
    objs = render(overlay)
    dep = one(objs, "Deployment", "kv-mds")
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    c = container(pod, "kv-mds")
    args = c["args"]
    assert c["command"][:2] == ["sh", "-c"] and 'exec kv-mds --listen "$h:7480" "$@"' in c["command"][2], c["command"]
    assert "--etcd=$(KVCELLAR_ETCD)" in args, args
    assert "--auth-token-file=/etc/kvcellar/token/token" in args, args
    env = {e["name"]: e["valueFrom"] for e in c["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}, env
    ref = env["KVCELLAR_ETCD"]["configMapKeyRef"]
    cm = configmap(objs, "kv-mds")
    assert ref == {"name": cm["metadata"]["name"], "key": "etcd"}, ref
    etcd = cm["data"]["etcd"]
    assert "UNSET" not in etcd and etcd, f"etcd endpoints not set: {etcd}"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    svc = one(objs, "Service", "kv-mds")
    assert selects({"matchLabels": svc["spec"]["selector"]}, labels), svc["spec"]["selector"]
    assert svc["spec"]["ports"][0]["port"] == 7480 and svc["spec"]["sessionAffinity"] == "ClientIP", svc["spec"]
    pdb = one(objs, "PodDisruptionBudget", "kv-mds")
    assert selects(pdb["spec"]["selector"], labels) and pdb["spec"]["minAvailable"] == 1, pdb["spec"]
    assert dep["spec"]["replicas"] >= 2
    uid, gid = image_ids()
    sc = pod["securityContext"]
    assert (sc["runAsUser"], sc["fsGroup"]) == (uid, gid), sc
    if "etcd-bundled" in json.dumps(objs) or any(o["kind"] == "StatefulSet" for o in objs):
        sts = one(objs, "StatefulSet", "kv-etcd")
        n = sts["spec"]["replicas"]
        want = ",".join(f"kv-etcd-{i}.kv-etcd:2379" for i in range(n))
        assert etcd == want, f"etcd endpoints {etcd}, the StatefulSet's {want}"
    sizing = check_mds_sizing(dep, c, cm)
    return f"etcd {etcd}; {sizing}"


def check_namespace(overlay):
    objs = render(overlay)
    stray = [f"{o['kind']}/{o['metadata']['name']}" for o in objs
             if o["kind"] != "Namespace" and o["metadata"].get("namespace") != "kvcellar"]
    assert not stray, f"objects outside the kvcellar namespace: {stray}"
    return f"{len(objs) - 1} objects in namespace kvcellar"


def check_policies(overlay):
    objs = render(overlay)
    host_net = one(objs, "DaemonSet", "kv-server")["spec"]["template"]["spec"].get("hostNetwork", False)
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    covered = set()
    for p in pols:
        for rule in p["spec"]["ingress"]:
            ports = {port["port"] for port in rule["ports"]}
            covered |= ports
            for src in rule["from"]:
                if "ipBlock" in src:
                    # Only nodes on their hosts' network reach kv-mds from
                    # host addresses: a private range, kv-mds's port alone.
                    cidr = src["ipBlock"]["cidr"]
                    private = cidr.startswith(("10.", "192.168.", "172.16.", "fd"))
                    ok = host_net and p["metadata"]["name"] == "kv-mds" and ports == {7480} and private
                    assert ok, f"{p['metadata']['name']} admits {cidr} on {sorted(ports)}"
    assert {7480, 7700, 9700} <= covered, covered
    return f"{len(pols)} policies, ports {sorted(covered)}"


def check_components():
    notes = []
    ds = lambda o: one(render(o), "DaemonSet", "kv-server")["spec"]["template"]["spec"]  # noqa: E731
    for o in ("example", "production"):
        assert not ds(o).get("hostNetwork"), f"{o}: host network is an overlay, off by default"
        assert "IPC_LOCK" not in json.dumps(ds(o)), f"{o}: RDMA is an overlay, off by default"
    for o in ("host-network", "rdma"):
        pod = ds(o)
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet", o
    pod = ds("rdma")
    c = container(pod, "kv-server")
    assert c["args"][0] == "--rdma-dev", c.get("args")
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    assert any(k.startswith("rdma/") for k in c["resources"]["limits"]), c["resources"]
    notes.append("rdma: device resource, IPC_LOCK, --rdma-dev")
    prod = render("production")
    mds = container(one(prod, "Deployment", "kv-mds")["spec"]["template"]["spec"], "kv-mds")
    for f in ("--etcd-cacert=", "--etcd-cert=", "--etcd-key="):
        assert any(a.startswith(f) for a in mds["args"]), f"production: kv-mds has no {f}"
    assert configmap(prod, "kv-mds")["data"]["etcd"].startswith("https://")
    vols = {v["name"]: v for v in one(prod, "Deployment", "kv-mds")["spec"]["template"]["spec"]["volumes"]}
    assert vols["etcd-tls"]["secret"]["secretName"] == "kvcellar-etcd-tls"
    notes.append("production: etcd over TLS from a Secret")
    # ServiceMonitors have no schema here: each must select a Service and name its port.
    sms = [o for o in prod if o["kind"] == "ServiceMonitor"]
    assert len(sms) == 2, sms
    for sm in sms:
        svcs = [s for s in prod if s["kind"] == "Service" and selects(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert svcs, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        for s in svcs:
            names = {p.get("name") for p in s["spec"]["ports"]}
            assert all(e["port"] in names for e in sm["spec"]["endpoints"]), (sm["metadata"]["name"], names)
    notes.append("ServiceMonitors select their Services' named ports")
    return "; ".join(notes)


# --- 4: start-node.sh --------------------------------------------------------


def run_stubbed(cmd, binary, env, files=None):
    """Runs `cmd` (sh) with a stand-in `binary` on PATH that prints its
    arguments, one a line; `files` are written to the work directory first
    ({name}) in `cmd` is that directory). The arguments printed."""
    with tempfile.TemporaryDirectory() as d:
        for name, text in (files or {}).items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        stub = os.path.join(d, binary)
        with open(stub, "w") as f:
            f.write('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
        os.chmod(stub, 0o755)
        out = subprocess.run([a.replace("{dir}", d) for a in cmd], env={"PATH": f"{d}:/usr/bin:/bin", **env},
                             capture_output=True, text=True, timeout=20, check=True)
    return out.stdout.splitlines()


def run_start_script(node_name, pod_ip):
    """Runs the rendered start-node.sh over a stand-in kv-server printing its arguments."""
    script = configmap(render("example"), "kv-server")["data"]["start-node.sh"]
    args = run_stubbed(["sh", "{dir}/start-node.sh", "--extra"], "kv-server",
                       {"NODE_NAME": node_name, "POD_IP": pod_ip}, {"start-node.sh": script})
    flag = lambda f: args[args.index(f) + 1]  # noqa: E731
    assert args[-1] == "--extra", "the pod's args are passed on"
    return flag("--id"), flag("--listen"), flag("--advertise"), flag("--metrics-listen")


def check_id_rule():
    label = "a" * 63
    cases = {
        "gpu-07": "gpu-07",
        "gpu-07.rack3.example.internal": "gpu-07.rack3.example.internal",
        "n" * 64: "n" * 64,
    }
    for name, want in cases.items():
        got = run_start_script(name, "10.0.0.7")[0]
        assert got == want, f"{name!r} -> {got!r}"
    ids = set()
    for name in ("n" * 65, f"{label}.{label}.{label}.{'b' * 61}", f"{label}.{label}.{label}.{'c' * 61}"):
        assert len(name) <= 253
        got = run_start_script(name, "10.0.0.7")[0]
        assert ID_RULE.match(got) and len(got) == 64, f"{len(name)}-character name -> {got!r}"
        assert got.endswith(hashlib.sha256(name.encode()).hexdigest()[:8]), got
        assert got == run_start_script(name, "10.0.0.7")[0], "the same node name, the same id"
        ids.add(got)
    assert len(ids) == 3, "names sharing their first 55 characters get different ids"
    _, listen, adv, met = run_start_script("gpu-07", "10.0.0.7")
    assert (listen, adv, met) == ("10.0.0.7:7700", "10.0.0.7:7700", "10.0.0.7:9700"), (listen, adv, met)
    _, listen, adv, _ = run_start_script("gpu-07", "fd00::7")
    assert (listen, adv) == ("[fd00::7]:7700", "[fd00::7]:7700"), (listen, adv)
    # kv-mds's command, as rendered: its listen address from the pod's.
    mds = container(one(render("example"), "Deployment", "kv-mds")["spec"]["template"]["spec"], "kv-mds")
    for ip, want in (("10.0.0.5", "10.0.0.5:7480"), ("fd00::5", "[fd00::5]:7480")):
        args = run_stubbed(mds["command"] + ["--etcd=e:2379"], "kv-mds", {"POD_IP": ip})
        assert args == ["--listen", want, "--etcd=e:2379"], args
    return ("names of 6-253 characters give ids of the 64-character rule, stable and distinct; "
            "IPv6 pod addresses bracketed for kv-server and kv-mds")


# --- 5: the pods' commands in containers --------------------------------------


def docker(*args, check=True, timeout=120):
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, token=None, timeout=3):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def wait(what, fn, secs=60):
    deadline = time.monotonic() + secs
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {secs} s")
        time.sleep(0.2)


def expand(arg, env):
    """Kubernetes' $(VAR) expansion in a container's args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def check_pods_in_docker(img):
    objs = render("example")
    cm = configmap(objs, "kv-server")
    ds_pod = one(objs, "DaemonSet", "kv-server")["spec"]["template"]["spec"]
    node_c = container(ds_pod, "kv-server")
    init_c = container(ds_pod, "disk-owner", init=True)
    mds_c = container(one(objs, "Deployment", "kv-mds")["spec"]["template"]["spec"], "kv-mds")
    uid, gid = image_ids()
    tag = f"kvk8stest{os.getpid()}"
    work = tempfile.mkdtemp(prefix="kvk8s")
    etcd = None
    net = None
    try:
        # The ConfigMap's files and the token Secret's file as the kubelet
        # lays them out: the token root-owned, group 900, mode 0440.
        cfg = os.path.join(work, "config")
        os.makedirs(cfg)
        for k, v in cm["data"].items():
            with open(os.path.join(cfg, k), "w") as f:
                f.write(v)
        tokdir = os.path.join(work, "token")
        os.makedirs(tokdir)
        token = os.path.join(tokdir, "token")
        with open(token, "w") as f:
            f.write("k8s-test-token-" + os.urandom(8).hex() + "\n")
        os.chown(token, 0, gid)
        os.chmod(token, 0o440)
        # A Docker network of this test's own: the pods' addresses, and the
        # name kv-mds (the node's kv-server.toml says kv-mds:7480).
        for third in range(200, 250):
            if docker("network", "create", "--subnet", f"172.31.{third}.0/24", f"{tag}net", check=False).returncode == 0:
                net = f"{tag}net"
                break
        assert net, "no free 172.31.x.0/24 for a test network"
        gw, mds_ip, node_ip = (f"172.31.{third}.{i}" for i in (1, 11, 10))
        # etcd on this host, at the network's gateway (a host address).
        with socket.socket() as a, socket.socket() as b:
            a.bind((gw, 0))
            b.bind((gw, 0))
            ep, pp = a.getsockname()[1], b.getsockname()[1]
        etcd = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", os.path.join(work, "etcd"),
             "--listen-client-urls", f"http://{gw}:{ep}", "--advertise-client-urls", f"http://{gw}:{ep}",
             "--listen-peer-urls", f"http://{gw}:{pp}", "--initial-advertise-peer-urls", f"http://{gw}:{pp}",
             "--initial-cluster", f"t=http://{gw}:{pp}", "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "etcd.log"), "w"))
        # kv-mds as its Deployment runs it (args expanded as Kubernetes does).
        mds_cm = configmap(objs, "kv-mds")["data"]
        mds_env = {"POD_IP": mds_ip, "KVCELLAR_ETCD": f"{gw}:{ep}",
                   "KVCELLAR_MAX_LONG_POLLS": mds_cm["max-long-polls"], "KVCELLAR_MAX_CONNS": mds_cm["max-conns"]}
        docker("run", "-d", "--name", f"{tag}-mds", "--network", net, "--ip", mds_ip, "--network-alias", "kv-mds",
               "--user", f"{uid}:{gid}", "--read-only", "--cap-drop", "ALL", "-e", f"POD_IP={mds_ip}",
               "-v", f"{tokdir}:/etc/kvcellar/token:ro", img, *mds_c["command"],
               *[expand(a, mds_env) for a in mds_c["args"]], "--lease-ttl", "3s")
        wait("kv-mds /healthz", lambda: http(f"http://{mds_ip}:7480/healthz")[0] == 200)
        assert http(f"http://{mds_ip}:7480/livez") == (200, "ok\n")
        # The disks: the init container's command hands them to uid 900.
        disks = []
        for i in range(2):
            d = os.path.join(work, f"disk{i}")
            os.makedirs(d)
            disks += ["-v", f"{d}:/data/disk{i}"]
        caps = sum((["--cap-add", c] for c in init_c["securityContext"]["capabilities"]["add"]), [])
        docker("run", "--rm", "--user", "0", "--cap-drop", "ALL", *caps, *disks, img, *init_c["command"])
        for i in range(2):
            st = os.stat(os.path.join(work, f"disk{i}"))
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o750), f"disk{i} not handed over: {st}"
        # kv-server as the DaemonSet runs it, on a long node name. The
        # test's only addition: small caps for this machine.
        node_name = "gpu-node-" + "x" * 70 + ".cluster.example.internal"
        want_id = node_name[:55] + "-" + hashlib.sha256(node_name.encode()).hexdigest()[:8]
        docker("run", "-d", "--name", f"{tag}-node", "--network", net, "--ip", node_ip, "--user", f"{uid}:{gid}",
               "--read-only", "--cap-drop", "ALL", "-e", f"NODE_NAME={node_name}", "-e", f"POD_IP={node_ip}",
               "-v", f"{cfg}/kv-server.toml:/etc/kvcellar/kv-server.toml:ro",
               "-v", f"{cfg}/start-node.sh:/etc/kvcellar/start-node.sh:ro",
               "-v", f"{tokdir}:/etc/kvcellar/token:ro", *disks,
               img, *node_c["command"], "--cap", "64M", "--mem-cap", "64M")
        tok = open(token).read().strip()
        view = wait("the node in kv-mds's view", lambda: (lambda r: r[0] == 200 and want_id in r[1] and json.loads(r[1]))(
            http(f"http://{mds_ip}:7480/v1/groups/default/view", tok)))
        member = next(m for m in view["members"] if m["id"] == want_id)
        assert member["addr"] == f"{node_ip}:7700", member
        wait("/readyz", lambda: http(f"http://{node_ip}:9700/readyz")[0] == 200)
        # A page through the group, with the token, from the image's kvctl.
        page = os.path.join(work, "page")
        with open(page, "wb") as f:
            f.write(os.urandom(256 << 10))
        kvctl = ["run", "--rm", "--network", "host", "-v", f"{tokdir}:/t:ro", "-v", f"{work}:/w", "--user", "0", img,
                 "kvctl", "--auth-token-file", "/t/token"]
        docker(*kvctl, "put", "--mds", f"{mds_ip}:7480", "k8s-page", "--file", "/w/page")
        docker(*kvctl, "get", "--mds", f"{mds_ip}:7480", "k8s-page", "--out", "/w/back")
        assert open(page, "rb").read() == open(os.path.join(work, "back"), "rb").read(), "the page read back differs"
        logs = docker("logs", f"{tag}-node").stderr
        assert "has mode" not in logs, "the token file's mode drew a warning"
        # A stop: unready and alive while draining (30 s); a second signal ends it.
        docker("kill", "-s", "TERM", f"{tag}-node")
        wait("/readyz 503 while draining", lambda: http(f"http://{node_ip}:9700/readyz") == (503, "draining\n"))
        assert http(f"http://{node_ip}:9700/livez") == (200, "ok\n")
        t0 = time.monotonic()
        docker("kill", "-s", "TERM", f"{tag}-node")
        code = docker("wait", f"{tag}-node", timeout=60).stdout.strip()
        took = time.monotonic() - t0
        assert code == "0", f"the node exited {code}"
        assert took < 15, f"the second signal did not end the 30 s drain: exit after {took:.1f} s"
        return (f"node id {want_id} ({len(want_id)} chars) at {node_ip}:7700, a 256 KiB page round-tripped, "
                f"a stop ended by a second signal in {took:.1f} s")
    except Exception:
        for c in (f"{tag}-mds", f"{tag}-node"):
            out = docker("logs", "--tail", "15", c, check=False)
            print(f"--- {c} log:\n{out.stdout}{out.stderr}", end="")
        if os.path.exists(os.path.join(work, "etcd.log")):
            print("--- etcd log:\n" + open(os.path.join(work, "etcd.log")).read()[-2000:])
        raise
    finally:
        for c in (f"{tag}-node", f"{tag}-mds"):
            docker("rm", "-f", c, check=False)
        if net:
            docker("network", "rm", net, check=False)
        if etcd:
            etcd.terminate()
            try:
                etcd.wait(timeout=20)
            except subprocess.TimeoutExpired:
                etcd.kill()
                etcd.wait()
        shutil.rmtree(work, ignore_errors=True)


def main():
    # A stop (SIGTERM, Ctrl-C) still removes what the run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    for o in OVERLAYS:
        check(f"{o}: renders, every object valid", lambda o=o: check_schemas(o))
    for o in OVERLAYS:
        check(f"{o}: kv-server DaemonSet", lambda o=o: check_node(o))
        check(f"{o}: kv-mds Deployment, Service, budget, etcd", lambda o=o: check_mds(o))
        check(f"{o}: NetworkPolicies", lambda o=o: check_policies(o))
        check(f"{o}: one namespace", lambda o=o: check_namespace(o))
    check("components: host network, RDMA, etcd over TLS, ServiceMonitors", check_components)
    check("start-node.sh: the node id rule and the pod address", check_id_rule)
    check("kv-mds sizing: a memory limit or caps below the fleet's need fail", check_sizing_rule)
    img = f"kvcellar:{version()}"
    have_docker = shutil.which("docker") and docker("info", check=False).returncode == 0
    skipped = 1
    if not have_docker:
        print("SKIPPED: no Docker engine answers here: the pods' commands were not run as containers")
    elif docker("image", "inspect", img, check=False).returncode != 0:
        print(f"SKIPPED: no image {img} (scripts/package.sh builds it): the pods' commands were not run as containers")
    elif os.geteuid() != 0:
        print("SKIPPED: not root: the token file cannot be given the kubelet's owner; the pods' commands were not run")
    else:
        skipped = 0
        check("the rendered pods' commands in containers", lambda: check_pods_in_docker(img))
    print("not run here: pods on a real cluster (no API server, kubelet or CNI on this machine)")
    print(f"k8s: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
