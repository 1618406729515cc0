"""Storage backends compared through the engines, the way a user chooses
between them (scripts/bench-backends.sh).

bench_plugins.py weighs our plugins against our own C ABI; this goes one
level up: each backend is built by the engine's own factory from the
engine's own config and driven through the calls the engine makes, on the
engine's own memory, so the figures are what an engine would see.

SGLang 0.5.23 (``sglang``, run with SGLang's venv): SGLang's real CPU host
pool (``MHATokenToKVPoolHost`` over an ``MHATokenToKVPool`` on device cpu,
layout page_first, fp16, Llama-3-8B-like: 32 layers, head_dim 128) at two
page geometries (``SGLANG_GEOMETRIES``):

- ``256K``: 1 KV head (one rank of TP 8), 16-token pages: K 128 KiB + V 128 KiB;
- ``4M``: 8 KV heads (TP 1), 32-token pages: K 2 MiB + V 2 MiB.

Backends, each made by ``StorageBackendFactory.create_backend`` and
attached as SGLang's cache controller attaches one
(``register_mem_pool_host``, then ``on_host_pools_registered``):

- ``kvcellar``: ``dynamic`` (kvcellar.hicache / KvcellarStorage,
  ``interface_v1`` 1) against 3 kv-server nodes on loopback started here
  with ``--mem-cap 1G`` (acknowledged once on media, the default);
- ``kvcellar-mem``: the same, nodes with ``--ack memory``;
- ``file``: SGLang's ``HiCacheFile`` on a directory of the same disk. It has
  no v1 methods (the base class's return None), so SGLang's controller
  drives it through its generic path, and so does this: per page
  ``get_data_page`` (a copy) then ``batch_set``; ``batch_get`` into
  ``get_dummy_flat_data_page`` tensors, then ``set_from_flat_data_page``;
- ``mooncake``: SGLang's ``MooncakeStore`` over Mooncake Store (PyPI
  mooncake-transfer-engine-non-cuda): a ``mooncake_master`` and three
  storage processes (``peers.py mooncake-serve``, 2 GiB of DRAM each), TCP,
  P2PHANDSHAKE metadata. See ``mooncake_extra`` for the config.

Per (backend, geometry), rounds of: fresh random bytes in 64 source pages,
fresh keys (pages are write-once), then timed from one thread ``set``
(``batch_set_v1``, or the generic path), ``exists`` (``batch_exists``,
expecting every key) and ``get`` (into 64 other, zeroed pages of the pool),
after which every byte of the pages read is compared with the pages
written. For ``file`` the written files are also fdatasync'ed, timed apart
(``set+sync``: HiCacheFile never syncs), and after the ``get`` (which the
page cache serves: the files were just written) they are dropped from the
page cache (POSIX_FADV_DONTNEED) and read again (``get cold``, verified
too).

LMCache 0.5.6 (``lmcache``, run with LMCache's venv): two storage backends
built by LMCache's ``CreateStorageBackends`` from an ``LMCacheEngineConfig``,
each driven through LMCache's storage-backend interface as its storage
manager drives it: ``batched_submit_put_task`` (with the per-key
``on_complete_callback``) and ``batched_get_blocking``, on the same chunks
(``LMCACHE_GEOMETRIES``: 256-token chunks, KV_2LTD fp16, 4 MiB and 32 MiB):

- ``kvcellar`` / ``kvcellar-mem``: ``RemoteBackend`` over kvcellar.lmcache
  (remote_storage_plugins, naive serde) against 3 nodes as above;
- ``local_disk``: ``LocalDiskBackend`` (``local_disk``,
  ``max_local_disk_size``; buffered writes, LMCache's default, by its 4 I/O
  threads).

A put is reported three ways: ``put returned`` (ms until the submit call
returns: both backends queue the work), ``put`` (until every key's
completion callback ran: kvcellar's nodes acknowledged / LocalDiskBackend's
threads finished their buffered writes) and for local_disk ``put+sync``
(``put`` plus an fdatasync of the new files by this harness). Gets are
verified byte for byte and released; local_disk also gets ``get cold`` as
``file`` does.

Round 0 of each (backend, geometry) warms up and is not counted. The order
of the backends rotates with ``--run``. Servers are started per backend and
stopped (by PID, reaped) before the next; their data directories are
removed. GB is 1e9 bytes. Each figure is a JSON line appended to ``--out``;
``table`` prints medians per run and over runs, plus kvcellar's ratios.

usage: backends.py sglang|lmcache --run N --out FILE --work DIR [--rounds R] ...
       backends.py table FILE
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers.py")
MODEL = "bench/llama-3-8b"
GB = 1e9

# Llama-3-8B-like shapes: 32 layers, head_dim 128, fp16.
SGLANG_GEOMETRIES = {
    "256K": {"layers": 32, "heads": 1, "head_dim": 128, "page_size": 16},  # 2 x 128 KiB a page
    "4M": {"layers": 32, "heads": 8, "head_dim": 128, "page_size": 32},  # 2 x 2 MiB a page
}
LMCACHE_GEOMETRIES = {
    "4M": {"layers": 32, "heads": 1, "head_dim": 128, "chunk": 256},  # 256 tokens x 16 KiB
    "32M": {"layers": 32, "heads": 8, "head_dim": 128, "chunk": 256},  # 256 tokens x 128 KiB
}

# What a completed set/put means, per engine and backend.
ACK = {
    ("sglang", "kvcellar"): "page on media at its node (O_DIRECT + fdatasync; --ack media, the default)",
    ("sglang", "kvcellar-mem"): "page in its node's memory tier, disk write queued (--ack memory)",
    ("sglang", "file"): "files in the page cache (buffered write + rename; no fsync); set+sync adds fdatasync",
    ("sglang", "mooncake"): "K and V objects in a storage process's DRAM segment (1 replica, no disk)",
    ("lmcache", "kvcellar"): "put: callback after the nodes acknowledged (on media, --ack media)",
    ("lmcache", "kvcellar-mem"): "put: callback after the nodes acknowledged (memory tier, --ack memory)",
    ("lmcache", "local_disk"): "put: callback after a buffered write (page cache); put+sync adds fdatasync",
}

# Operations per engine: (name, unit); GB/s figures are bytes / seconds.
OPS = {
    "sglang": [("set", "GB/s"), ("set+sync", "GB/s"), ("exists", "ms"), ("get", "GB/s"), ("get cold", "GB/s")],
    "lmcache": [("put returned", "ms"), ("put", "GB/s"), ("put+sync", "GB/s"), ("get", "GB/s"), ("get cold", "GB/s")],
}
OTHERS = {"sglang": ["mooncake", "file"], "lmcache": ["local_disk"]}
# Columns without a kvcellar ratio: a queueing time, and reads only the file stores have.
NO_RATIO = ("put returned", "get cold")


class BenchError(Exception):
    """A backend failed a round (wrong bytes, a miss, a failed write)."""


def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connectable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def fdatasync_files(paths: List[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def drop_cached(paths: List[str]) -> None:
    """Evicts these (synced, so clean) files from the page cache, so that
    the next read comes from the device: POSIX_FADV_DONTNEED, per file."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _die_with_parent() -> None:
    """In a child: SIGKILL when this harness dies, even by a crash that skips
    every finally (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


# -- child processes ---------------------------------------------------------


class Children:
    """The processes one backend needs, started here; each is stopped by its
    own PID (SIGTERM, SIGKILL after 20 s) and reaped on leaving the block.
    Their stdout and stderr go to NAME.out and NAME.log in ``logdir``."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.procs: List[Tuple[str, subprocess.Popen]] = []
        os.makedirs(logdir, exist_ok=True)

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, name: str, argv: List[str]) -> subprocess.Popen:
        with open(self._path(name, ".out"), "wb") as out, open(self._path(name, ".log"), "wb") as err:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 preexec_fn=_die_with_parent)
        self.procs.append((name, p))
        return p

    def _path(self, name: str, ext: str) -> str:
        return os.path.join(self.logdir, name + ext)

    def text(self, name: str, ext: str) -> str:
        try:
            with open(self._path(name, ext), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_until(self, what: str, ready: Callable[[], Any], secs: float, name: str) -> Any:
        """Polls ``ready`` until it returns something true, ``secs`` pass or
        the process ``name`` exits."""
        proc = dict(self.procs)[name]
        end = time.monotonic() + secs
        while True:
            r = ready()
            if r:
                return r
            if proc.poll() is not None:
                tail = self.text(name, ".log")[-1500:]
                raise RuntimeError(f"{what} exited with status {proc.returncode}: {tail.strip()}")
            if time.monotonic() > end:
                raise RuntimeError(f"{what} not ready after {secs:.0f} s (logs in {self.logdir})")
            time.sleep(0.05)

    def wait_for_line(self, name: str, ext: str, marker: str, secs: float) -> str:
        def found() -> Optional[str]:
            for line in self.text(name, ext).splitlines():
                if marker in line:
                    return line
            return None

        return self.wait_until(f"{name} ({marker!r})", found, secs, name)

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 20
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def start_kvcellar(ch: Children, bin_dir: str, data: str, ack_memory: bool) -> str:
    """Three kv-server nodes on loopback, each with a disk directory under
    ``data`` and a 1 GiB memory tier; returns the member list once each
    listens and has faulted its memory arena in."""
    for i in range(3):
        argv = [os.path.join(bin_dir, "kv-server"), "--listen", "127.0.0.1:0", "--dir", os.path.join(data, f"n{i}"),
                "--cap", "4G", "--mem-cap", "1G", "--log-level", "info", "--drain-secs", "0"]
        ch.start(f"n{i}", argv + (["--ack", "memory"] if ack_memory else []))
    members = []
    for i in range(3):
        line = ch.wait_for_line(f"n{i}", ".out", "kv-server listening on ", 30)
        members.append(f"n{i}={line.rsplit(' ', 1)[1].strip()}")
        ch.wait_for_line(f"n{i}", ".log", "memory arena faulted in", 60)
    return ",".join(members)


def start_mooncake(ch: Children, segment: str) -> str:
    """A mooncake_master on 127.0.0.1 and three storage processes that each
    contribute a DRAM segment of ``segment`` bytes; returns the master's
    address once every storage process has mounted its segment."""
    port, metrics = free_port(), free_port()
    master = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(master):
        master = shutil.which("mooncake_master") or master
    ch.start("master", [master, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                        "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"])
    ch.wait_until("mooncake_master", lambda: connectable(port), 30, "master")
    addr = f"127.0.0.1:{port}"
    for i in range(3):
        ch.start(f"store{i}", [sys.executable, PEERS, "mooncake-serve", "--master", addr, "--segment", segment])
    for i in range(3):
        ch.wait_for_line(f"store{i}", ".out", "READY", 90)
    return addr


# -- results -----------------------------------------------------------------


class Results:
    def __init__(self, path: str, engine: str, run: int) -> None:
        self.path, self.engine, self.run = path, engine, run

    def _write(self, rec: Dict[str, Any]) -> None:
        rec.update(engine=self.engine, run=self.run)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def info(self, geometry: str, backend: str, **kw: Any) -> None:
        self._write({"type": "info", "geometry": geometry, "backend": backend, **kw})

    def figure(self, geometry: str, backend: str, op: str, rnd: int, secs: float, nbytes: int) -> None:
        unit = dict(OPS[self.engine])[op]
        value = secs * 1e3 if unit == "ms" else nbytes / secs / GB
        self._write({"type": "figure", "geometry": geometry, "backend": backend, "op": op, "round": rnd,
                     "secs": secs, "bytes": nbytes, "value": value, "unit": unit})

    def status(self, geometry: str, backend: str, status: str, reason: str) -> None:
        reason = " ".join(reason.split())[:400]
        print(f"  {self.engine} {geometry} {backend}: {status}: {reason}", flush=True)
        self._write({"type": "status", "geometry": geometry, "backend": backend, "status": status, "reason": reason})


def rotated(items: List[str], run: int) -> List[str]:
    k = (run - 1) % len(items) if items else 0
    return items[k:] + items[:k]


def report_round(res: Results, geometry: str, backend: str, rnd: int, secs: Dict[str, float],
                 nbytes: int) -> None:
    """One line per round (every round printed); figures kept from round 1."""
    parts = []
    for op, unit in OPS[res.engine]:
        if op in secs:
            v = secs[op] * 1e3 if unit == "ms" else nbytes / secs[op] / GB
            parts.append(f"{op} {v:6.3f} {unit}" if unit == "GB/s" else f"{op} {v:7.2f} ms")
            if rnd:
                res.figure(geometry, backend, op, rnd, secs[op], nbytes)
    tag = "warm-up" if rnd == 0 else f"round {rnd}"
    print(f"  {res.engine} {geometry:>4} {backend:<12} {tag:<8} " + "  ".join(parts) + "  verified", flush=True)


# -- SGLang ------------------------------------------------------------------


def storage_config(extra: Dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=MODEL, extra_config=extra)


def mooncake_extra(master: str) -> Dict[str, Any]:
    """SGLang's MooncakeStore config, as --hicache-storage-backend-extra-config
    gives it (its first source; then SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, then
    MOONCAKE_* variables, which the driver leaves unset).

    ``global_segment_size`` 0: the SGLang process contributes no DRAM and
    every page lands in the three storage processes, as SGLang's Mooncake
    guide deploys it with separate store services (a non-zero size, 4 GB by
    default, would make the engine a storage node too, its puts partly local
    memory copies). That matches kvcellar's setup: the engine is a client of
    three storage processes. TCP: no RDMA here; P2PHANDSHAKE: no metadata
    server; SGLang registers its host pool with Mooncake (zero copy from it).
    """
    return {"master_server_address": master, "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "device_name": "", "global_segment_size": 0, "check_server": False}


class SglangPool:
    """SGLang's real host pool for one geometry: source pages first, then as
    many destination pages."""

    def __init__(self, geometry: str, pages: int) -> None:
        import torch
        from pools import indices_for  # plugins/tests
        from real_pools import make_real_pool

        g = SGLANG_GEOMETRIES[geometry]
        ps = g["page_size"]
        self.pool = make_real_pool("mha", "page_first", 2 * pages * ps, ps, g["layers"], g["heads"], g["head_dim"])
        if type(self.pool).__name__ != "MHATokenToKVPoolHost" or self.pool.layout != "page_first":
            raise RuntimeError(f"not SGLang's page_first MHA host pool: {type(self.pool)}")
        self.pages, self.ps = pages, ps
        self.src, self.dst = indices_for(self.pool, 0, pages), indices_for(self.pool, pages, pages)
        _, sizes = self.pool.get_page_buffer_meta(self.src)
        self.page_bytes = sum(sizes) // pages
        self.batch_bytes = sum(sizes)
        # page_first: kv_buffer is [K|V, token, layer, head, dim]; pages are token ranges.
        self.kv = self.pool.kv_buffer.view(torch.int16)
        self.src_tokens = slice(0, pages * ps)
        self.dst_tokens = slice(pages * ps, 2 * pages * ps)

    def refill_sources(self) -> None:
        self.kv[:, self.src_tokens].random_()

    def zero_destinations(self) -> None:
        self.kv[:, self.dst_tokens].zero_()

    def same(self) -> bool:
        import torch

        return torch.equal(self.kv[:, self.src_tokens], self.kv[:, self.dst_tokens])


def sglang_backend(name: str, pool: Any, members: str, master: str, file_dir: str) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    if name.startswith("kvcellar"):
        kind = "dynamic"
        extra = {"backend_name": "kvcellar", "module_path": "kvcellar.hicache", "class_name": "KvcellarStorage",
                 "interface_v1": 1, "members": members, "io_timeout_ms": 60000, "model_fingerprint": "bench-weights",
                 # Far above a batch's time: a batch moves as one call (the defaults slice large ones).
                 "load_deadline_ms": 60000, "save_deadline_ms": 60000, "lookup_deadline_ms": 60000}
    elif name == "file":
        kind, extra = "file", {"file_storage_path": file_dir}
    elif name == "mooncake":
        kind, extra = "mooncake", mooncake_extra(master)
    else:
        raise ValueError(name)
    b = StorageBackendFactory.create_backend(kind, storage_config(extra), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def sglang_calls(name: str, b: Any, pool: Any) -> Tuple[Callable, Callable]:
    """(set, get) as SGLang's cache controller calls this backend: the v1
    zero-copy calls, or for ``file`` the generic path over flat pages."""
    if name != "file":
        return b.batch_set_v1, b.batch_get_v1
    ps = pool.page_size

    def set_(keys: List[str], idx: Any) -> List[bool]:
        data = [pool.get_data_page(int(idx[i * ps])) for i in range(len(keys))]
        return [bool(b.batch_set(keys, data))] * len(keys)

    def get_(keys: List[str], idx: Any) -> List[bool]:
        got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        ok = []
        for i, page in enumerate(got):
            if page is None:
                break
            pool.set_from_flat_data_page(int(idx[i * ps]), page)
            ok.append(True)
        return ok + [False] * (len(keys) - len(ok))

    return set_, get_


def bench_sglang_backend(res: Results, name: str, geometry: str, sp: SglangPool, b: Any, rounds: int,
                         file_dir: str) -> None:
    set_, get_ = sglang_calls(name, b, sp.pool)
    nonce = uuid.uuid4().hex[:8]  # keys of this (backend, geometry) only: pages are write-once
    n, nbytes = sp.pages, sp.batch_bytes

    def get_checked(r: int, what: str) -> float:
        sp.zero_destinations()
        t, ok = timed(lambda: get_(keys, sp.dst))
        if not all(ok):
            raise BenchError(f"round {r}: {what} read {sum(map(bool, ok))} of {n} pages")
        if not sp.same():
            raise BenchError(f"round {r}: {what}: the pages read differ from the pages written")
        return t

    for r in range(rounds + 1):
        sp.refill_sources()
        keys = [f"{nonce}{res.run:02x}{r:04x}{i:050x}" for i in range(n)]
        secs: Dict[str, float] = {}
        before = set(os.listdir(file_dir)) if name == "file" else set()
        secs["set"], ok = timed(lambda: set_(keys, sp.src))
        if not all(ok):
            raise BenchError(f"round {r}: set stored {sum(map(bool, ok))} of {n} pages")
        new: List[str] = []
        if name == "file":
            new = [os.path.join(file_dir, f) for f in set(os.listdir(file_dir)) - before if f.endswith(".bin")]
            if len(new) != n:
                raise BenchError(f"round {r}: {len(new)} new files for {n} pages")
            secs["set+sync"] = secs["set"] + timed(lambda: fdatasync_files(new))[0]
        secs["exists"], hits = timed(lambda: b.batch_exists(keys))
        if hits != n:
            raise BenchError(f"round {r}: batch_exists found {hits} of {n} pages just stored")
        secs["get"] = get_checked(r, "get")
        if name == "file":
            drop_cached(new)
            secs["get cold"] = get_checked(r, "get cold")
        report_round(res, geometry, name, r, secs, nbytes)


def cmd_sglang(a: argparse.Namespace) -> int:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import sglang

    res = Results(a.out, "sglang", a.run)
    geometries = a.geometries.split(",")
    pools = {}
    for g in geometries:
        pools[g] = SglangPool(g, a.pages)
        print(f"sglang {sglang.__version__}: {g}: {type(pools[g].pool).__name__} page_first, "
              f"{pools[g].page_bytes} bytes a page ({SGLANG_GEOMETRIES[g]}), {a.pages} pages a batch", flush=True)
    failed = 0
    for name in rotated(a.backends.split(","), a.run):
        for g in geometries:
            res.info(g, name, ack=ACK[("sglang", name)], page_bytes=pools[g].page_bytes, pages=a.pages,
                     batch_bytes=pools[g].batch_bytes)
        if name in a.skip:
            for g in geometries:
                res.status(g, name, "not run", a.skip[name])
            continue
        data = os.path.join(a.work, f"data-run{a.run}-sglang-{name}")  # removed after the backend
        try:
            with Children(os.path.join(a.work, "logs", f"run{a.run}-sglang-{name}")) as ch:
                members = master = ""
                try:
                    if name.startswith("kvcellar"):
                        members = start_kvcellar(ch, a.bin_dir, data, ack_memory=name == "kvcellar-mem")
                    elif name == "mooncake":
                        master = start_mooncake(ch, a.mc_segment)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    for g in geometries:
                        res.status(g, name, "not run", f"servers did not start: {e}")
                    failed += 1
                    continue
                for g in geometries:
                    file_dir = os.path.join(data, f"files-{g}")
                    if name == "file":
                        os.makedirs(file_dir, exist_ok=True)
                    try:
                        b = sglang_backend(name, pools[g].pool, members, master, file_dir)
                    except Exception as e:  # noqa: BLE001
                        res.status(g, name, "not run", f"{type(e).__name__}: {e}")
                        failed += 1
                        continue
                    try:
                        bench_sglang_backend(res, name, g, pools[g], b, a.rounds, file_dir)
                    except Exception as e:  # noqa: BLE001
                        res.status(g, name, "failed", f"{type(e).__name__}: {e}")
                        failed += 1
                    finally:
                        if hasattr(b, "close"):
                            b.close()
        finally:
            shutil.rmtree(data, ignore_errors=True)
    return 1 if failed else 0


# -- LMCache -----------------------------------------------------------------


class LmcacheSide:
    """One LMCache storage backend (RemoteBackend over kvcellar.lmcache, or
    LocalDiskBackend) and its LocalCPUBackend, built by LMCache's
    CreateStorageBackends on its own event loop."""

    def __init__(self, name: str, geometry: str, chunks: int, members: str, disk_dir: str,
                 disk_gib: float) -> None:
        import asyncio

        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        g = LMCACHE_GEOMETRIES[geometry]
        self.g, self.name = g, name
        self.chunk_bytes = 2 * g["layers"] * g["chunk"] * g["heads"] * g["head_dim"] * 2
        cpu_gib = 3 * chunks * self.chunk_bytes / (1 << 30) + 0.25  # the chunks, the gets' buffers, slack
        common = {"chunk_size": g["chunk"], "local_cpu": True, "max_local_cpu_size": cpu_gib}
        if name.startswith("kvcellar"):
            p = "remote_storage_plugin.kvcellar."
            extra = {p + "module_path": "kvcellar.lmcache", p + "class_name": "KvcellarConnector",
                     p + "members": members, p + "io_timeout_ms": 60000, p + "model_fingerprint": "bench-weights",
                     p + "load_deadline_ms": 60000, p + "save_deadline_ms": 60000, p + "lookup_deadline_ms": 60000}
            cfg = LMCacheEngineConfig.from_defaults(**common, remote_serde="naive", remote_storage_plugins=["kvcellar"],
                                                    extra_config=extra)
            key = "RemoteBackend-kvcellar"
        else:
            cfg = LMCacheEngineConfig.from_defaults(**common, local_disk=disk_dir, max_local_disk_size=disk_gib)
            key = "LocalDiskBackend"
        self.metadata = LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.float16, kv_shape=(g["layers"], 2, g["chunk"], g["heads"], g["head_dim"]),
            chunk_size=g["chunk"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backends: Dict[str, Any] = {}
        try:
            self.backends = CreateStorageBackends(cfg, self.metadata, self.loop)
            self.cpu = self.backends["LocalCPUBackend"]
            self.store = self.backends.get(key)
            if self.store is None or getattr(self.store, "connection", True) is None:
                raise RuntimeError(f"LMCache built no {key} (its log says why)")
            self.objs = [self.allocate() for _ in range(chunks)]
        except BaseException:
            self.close()
            raise

    def allocate(self) -> Any:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        g = self.g
        o = self.cpu.allocate([torch.Size([2, g["layers"], g["chunk"], g["heads"] * g["head_dim"]])],
                              [torch.float16], MemoryFormat.KV_2LTD)
        if o is None or o.get_size() != self.chunk_bytes:
            raise RuntimeError("LocalCPUBackend could not allocate a chunk")
        return o

    @staticmethod
    def data(o: Any) -> Any:
        import torch

        return torch.frombuffer(o.byte_array.cast("B"), dtype=torch.uint8)[: o.get_size()]

    def keys(self, nonce: str, run: int, rnd: int) -> List[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        return [CacheEngineKey(MODEL, 1, 0, int(f"{nonce}{run:02x}{rnd:04x}{i:04x}", 16), torch.float16)
                for i in range(len(self.objs))]

    def close(self) -> None:
        for o in getattr(self, "objs", []):
            while o.get_ref_count() > 0:
                o.ref_count_down()
        self.objs = []
        for b in reversed(list(self.backends.values())):
            b.close()
        self.backends = {}
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def bench_lmcache_backend(res: Results, name: str, geometry: str, side: LmcacheSide, rounds: int,
                          disk_dir: str) -> None:
    import torch

    nonce = uuid.uuid4().hex[:8]  # keys of this (backend, geometry) only: chunks are write-once
    n = len(side.objs)
    nbytes = n * side.chunk_bytes

    def get_checked(r: int, what: str) -> float:
        t, got = timed(lambda: side.store.batched_get_blocking(keys))
        try:
            hits = sum(g is not None for g in got)
            if hits != n:
                raise BenchError(f"round {r}: {what} returned {hits} of {n} chunks")
            if not all(torch.equal(side.data(g), side.data(o)) for g, o in zip(got, side.objs)):
                raise BenchError(f"round {r}: {what}: the chunks read differ from the chunks written")
        finally:
            for g in got:
                if g is not None:
                    g.ref_count_down()
        return t

    for r in range(rounds + 1):
        for o in side.objs:
            side.data(o).random_()
        keys = side.keys(nonce, res.run, r)
        secs: Dict[str, float] = {}
        before = set(os.listdir(disk_dir)) if name == "local_disk" else set()
        lock, all_done = threading.Lock(), threading.Event()
        done_at: List[float] = []

        def on_done(key: Any) -> None:
            with lock:
                done_at.append(time.perf_counter())
                if len(done_at) == n:
                    all_done.set()

        t0 = time.perf_counter()
        side.store.batched_submit_put_task(keys, side.objs, on_complete_callback=on_done)
        secs["put returned"] = time.perf_counter() - t0
        if not all_done.wait(120):
            raise BenchError(f"round {r}: {len(done_at)} of {n} puts completed within 120 s")
        secs["put"] = max(done_at) - t0
        new: List[str] = []
        if name == "local_disk":
            new = [os.path.join(disk_dir, f) for f in set(os.listdir(disk_dir)) - before]
            if len(new) != n:
                raise BenchError(f"round {r}: {len(new)} new files for {n} chunks")
            secs["put+sync"] = secs["put"] + timed(lambda: fdatasync_files(new))[0]
        secs["get"] = get_checked(r, "get")
        if name == "local_disk":
            drop_cached(new)
            secs["get cold"] = get_checked(r, "get cold")
        report_round(res, geometry, name, r, secs, nbytes)


def cmd_lmcache(a: argparse.Namespace) -> int:
    import lmcache

    res = Results(a.out, "lmcache", a.run)
    geometries = a.geometries.split(",")
    print(f"lmcache {getattr(lmcache, '__version__', '?')}: chunks of {a.chunks} a batch: "
          + ", ".join(f"{g} {LMCACHE_GEOMETRIES[g]}" for g in geometries), flush=True)
    failed = 0
    for name in rotated(a.backends.split(","), a.run):
        for g in geometries:
            gg = LMCACHE_GEOMETRIES[g]
            cb = 2 * gg["layers"] * gg["chunk"] * gg["heads"] * gg["head_dim"] * 2
            res.info(g, name, ack=ACK[("lmcache", name)], page_bytes=cb, pages=a.chunks, batch_bytes=cb * a.chunks)
        if name in a.skip:
            for g in geometries:
                res.status(g, name, "not run", a.skip[name])
            continue
        data = os.path.join(a.work, f"data-run{a.run}-lmcache-{name}")  # removed after the backend
        try:
            with Children(os.path.join(a.work, "logs", f"run{a.run}-lmcache-{name}")) as ch:
                members = ""
                if name.startswith("kvcellar"):
                    try:
                        members = start_kvcellar(ch, a.bin_dir, data, ack_memory=name == "kvcellar-mem")
                    except Exception as e:  # noqa: BLE001
                        for g in geometries:
                            res.status(g, name, "not run", f"servers did not start: {e}")
                        failed += 1
                        continue
                for g in geometries:
                    disk_dir = os.path.join(data, f"disk-{g}")
                    if name == "local_disk":
                        os.makedirs(disk_dir, exist_ok=True)
                    gg = LMCACHE_GEOMETRIES[g]
                    cb = 2 * gg["layers"] * gg["chunk"] * gg["heads"] * gg["head_dim"] * 2
                    disk_gib = 2 * (a.rounds + 1) * a.chunks * cb / (1 << 30) + 1  # never evicts
                    try:
                        side = LmcacheSide(name, g, a.chunks, members, disk_dir, disk_gib)
                    except Exception as e:  # noqa: BLE001
                        res.status(g, name, "not run", f"{type(e).__name__}: {e}")
                        failed += 1
                        continue
                    try:
                        bench_lmcache_backend(res, name, g, side, a.rounds, disk_dir)
                    except Exception as e:  # noqa: BLE001
                        res.status(g, name, "failed", f"{type(e).__name__}: {e}")
                        failed += 1
                    finally:
                        side.close()
        finally:
            shutil.rmtree(data, ignore_errors=True)
    return 1 if failed else 0


# -- the table ---------------------------------------------------------------


def fmt_size(b: int) -> str:
    return f"{b / (1 << 20):g} MiB" if b >= 1 << 20 else f"{b / 1024:g} KiB"


def cmd_table(a: argparse.Namespace) -> int:
    recs = [json.loads(line) for line in open(a.results) if line.strip()]
    figs = [r for r in recs if r["type"] == "figure"]
    runs = sorted({r["run"] for r in recs})
    print(f"GB = 1e9 bytes. Each cell: the median over runs of each run's median over its counted rounds "
          f"(round 0 warms up), then every run's median in brackets. {len(runs)} run(s).")

    def per_run(engine: str, g: str, b: str, op: str) -> List[Optional[float]]:
        out = []
        for run in runs:
            v = [r["value"] for r in figs if (r["engine"], r["geometry"], r["backend"], r["op"], r["run"]) ==
                 (engine, g, b, op, run)]
            out.append(statistics.median(v) if v else None)
        return out

    def med(engine: str, g: str, b: str, op: str) -> Optional[float]:
        v = [x for x in per_run(engine, g, b, op) if x is not None]
        return statistics.median(v) if v else None

    def num(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.3f}" if x < 100 else f"{x:.0f}"

    for engine in ("sglang", "lmcache"):
        erecs = [r for r in recs if r["engine"] == engine]
        if not erecs:
            continue
        ops = OPS[engine]
        for g in sorted({r["geometry"] for r in erecs}, key=lambda s: float(s[:-1]) * (1024 if s[-1] == "M" else 1)):
            infos = {r["backend"]: r for r in erecs if r["type"] == "info" and r["geometry"] == g}
            backends = list(dict.fromkeys(r["backend"] for r in erecs if r["geometry"] == g and r["type"] == "info"))
            any_info = next(iter(infos.values()))
            unit_name = "pages" if engine == "sglang" else "chunks"
            title = ("SGLang 0.5.23 HiCache, real MHA page_first host pool" if engine == "sglang"
                     else "LMCache 0.5.6 storage backends, KV_2LTD chunks of 256 tokens")
            print(f"\n{title}: batches of {any_info['pages']} {unit_name} of {fmt_size(any_info['page_bytes'])} "
                  f"({fmt_size(any_info['batch_bytes'])}), one thread")
            head = f"{'backend':<24}" + "".join(f" {op + ' ' + unit:>26}" for op, unit in ops)
            print(head)
            for b in backends:
                st = [r for r in erecs if r["type"] == "status" and r["geometry"] == g and r["backend"] == b]
                cells = []
                for op, _ in ops:
                    pr = per_run(engine, g, b, op)
                    if all(x is None for x in pr):
                        cells.append("-")
                    else:
                        cells.append(f"{num(med(engine, g, b, op))} [{' '.join(num(x) for x in pr)}]")
                print(f"{b:<24}" + "".join(f" {c:>26}" for c in cells))
                for s in st:
                    print(f"{'':<24} run {s['run']}: {s['status']}: {s['reason']}")
            # kvcellar's speed over each other backend's: GB/s over GB/s; for ms, theirs over ours.
            for ours in [b for b in backends if b.startswith("kvcellar")]:
                for other in [o for o in OTHERS[engine] if o in backends]:
                    cells = []
                    for op, unit in ops:
                        if op in NO_RATIO:
                            cells.append("")
                            continue
                        x, y = med(engine, g, ours, op), med(engine, g, other, op)
                        if op.endswith("+sync") and ours == "kvcellar":
                            # kvcellar's set/put is acknowledged on media already.
                            x = med(engine, g, ours, op.split("+")[0])
                        if x is None or y is None or x == 0 or y == 0:
                            cells.append("-")
                        else:
                            cells.append(f"{(x / y if unit == 'GB/s' else y / x):.2f}x")
                    print(f"{ours + '/' + other:<24}" + "".join(f" {c:>26}" for c in cells))
            print("acknowledged on set/put:")
            for b in backends:
                print(f"  {b:<12} {infos[b]['ack']}")
    print("\nratios: kvcellar's speed over the other's (GB/s over GB/s; for ms columns, their time over ours); "
          "in the +sync columns, kvcellar's own set/put (acknowledged on media already) over the other's "
          "set/put plus fdatasync.")
    return 0


def main(argv: List[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run every finally: children are stopped
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for engine, backends, geometries, default_n in (
        ("sglang", "kvcellar,kvcellar-mem,file,mooncake", "256K,4M", 64),
        ("lmcache", "kvcellar,kvcellar-mem,local_disk", "4M,32M", 8),
    ):
        s = sub.add_parser(engine)
        s.add_argument("--run", type=int, default=1)
        s.add_argument("--rounds", type=int, default=5, help="counted rounds (plus a warm-up round 0)")
        s.add_argument("--out", required=True, help="JSON lines are appended here")
        s.add_argument("--work", required=True, help="directory for the stores' data and the servers' logs")
        s.add_argument("--bin-dir", default=os.path.join(HERE, "..", "..", "target", "release"))
        s.add_argument("--backends", default=backends)
        s.add_argument("--geometries", default=geometries)
        s.add_argument("--skip", action="append", default=[], metavar="BACKEND=REASON",
                       help="report BACKEND as not run, with REASON")
        if engine == "sglang":
            s.add_argument("--pages", type=int, default=default_n)
            s.add_argument("--mc-segment", default="2G", help="DRAM of each Mooncake storage process")
        else:
            s.add_argument("--chunks", type=int, default=default_n)
    t = sub.add_parser("table")
    t.add_argument("results")
    a = p.parse_args(argv)
    if a.cmd == "table":
        return cmd_table(a)
    a.skip = dict(s.split("=", 1) for s in a.skip)
    os.makedirs(a.work, exist_ok=True)
    return cmd_sglang(a) if a.cmd == "sglang" else cmd_lmcache(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
