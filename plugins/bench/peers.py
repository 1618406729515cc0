"""One harness, one workload, three KV-cache stores (scripts/bench-peers.sh).

The same pages go through each system's own batch calls from caller
buffers: kvcellar (libkvclient.so, ``kv_batch_putv`` / ``kv_batch_getv``
through :mod:`kvcellar.client`), DingoCache (``libdfkv.so``,
``dfkv_batch_put`` / ``dfkv_batch_get``, declared here from its public C
header) and Mooncake Store (``batch_put_from`` / ``batch_get_into`` on
registered buffers). ctypes and Mooncake's bindings release the GIL, so
the client threads run concurrently.

Workload per (system, page size): THREADS threads, each owning a source and
a destination buffer of BATCH pages; about BYTES of fresh pages are put in
batches of BATCH (every page's first and last 8 bytes stamped with its
number), then the same pages are got back into the destination buffer and
each page's length and first and last 8 bytes are checked. GB is 1e9 bytes.

Subcommands::

    peers.py run --system kvcellar|dfkv|mooncake --target T --sizes 64K,4M ...
        one JSON line per (size, op) appended to --out, a summary on stdout
    peers.py mooncake-serve --master HOST:PORT --segment BYTES
        a Mooncake storage process contributing a DRAM segment; prints READY
    peers.py table RESULTS.jsonl
        the comparison table (medians over runs)

Nothing here starts servers; scripts/bench-peers.sh does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import statistics
import struct
import sys
import threading
import time
from typing import Callable, List, Sequence, Tuple

ACK = {
    "kvcellar": "media (O_DIRECT + fdatasync)",
    "kvcellar-mem": "node memory tier (--ack memory)",
    "dfkv": "page cache (buffered pwrite, no fsync)",
    "mooncake": "remote DRAM segment",
}


def parse_size(s: str) -> int:
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


def buf_addr(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


# -- backends: each exposes put(keys, addrs, size) -> #ok and
#    get(keys, addrs, size) -> list of lengths (-1 on miss/error) -----------


class Kvcellar:
    def __init__(self, target: str) -> None:
        from kvcellar.client import Client, Status  # PYTHONPATH=plugins, KVCELLAR_LIB

        self.ok = Status.OK
        self.c = Client(target)

    def register(self, addr: int, n: int, mm: mmap.mmap) -> None:
        pass  # TCP: kv_register_memory does nothing

    def put(self, keys: List[bytes], addrs: List[int], size: int) -> int:
        st = self.c.batch_putv_raw(keys, addrs, [size] * len(keys), 1)
        return sum(1 for s in st if s == self.ok)

    def get(self, keys: List[bytes], addrs: List[int], size: int) -> List[int]:
        rs = self.c.batch_getv_raw(keys, addrs, [size] * len(keys), 1)
        return [r.length if r.status == self.ok else -1 for r in rs]

    def close(self) -> None:
        self.c.close()


class _DfkvOptions(ctypes.Structure):
    # dfkv_client_options_v2, from src/client/dfkv_c_api.h (DingoCache v2.7.0)
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("abi_version", ctypes.c_uint32),
        ("members", ctypes.c_char_p),
        ("key_namespace", ctypes.c_void_p),
        ("key_namespace_len", ctypes.c_uint64),
        ("batch_concurrency", ctypes.c_uint64),
        ("mds_endpoints", ctypes.c_char_p),
        ("mds_group", ctypes.c_char_p),
        ("mds_poll_ms", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("client_id", ctypes.c_char_p),
        ("client_info", ctypes.c_char_p),
        ("client_heartbeat_ms", ctypes.c_int32),
        ("reserved0", ctypes.c_uint32),
    ]


class Dfkv:
    NAMESPACE = b"kvcellar-bench-peers"

    def __init__(self, target: str) -> None:
        lib_path = os.path.join(os.environ["DFKV_PREFIX"], "libdfkv.so")
        lib = ctypes.CDLL(lib_path)
        P, U64P = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)
        lib.dfkv_open_v2.restype = P
        lib.dfkv_open_v2.argtypes = [ctypes.POINTER(_DfkvOptions)]
        for name in ("dfkv_batch_put", "dfkv_batch_get"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [P, ctypes.POINTER(P), U64P, ctypes.POINTER(P), U64P, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.dfkv_close.argtypes = [P]
        lib.dfkv_close.restype = None
        lib.dfkv_transport_mode.argtypes = [P]
        lib.dfkv_transport_mode.restype = ctypes.c_char_p
        self.lib = lib
        self._ns = ctypes.create_string_buffer(self.NAMESPACE, len(self.NAMESPACE))
        self._members = target.encode()
        o = _DfkvOptions()
        o.struct_size = ctypes.sizeof(_DfkvOptions)
        o.abi_version = 2
        o.members = self._members
        o.key_namespace = ctypes.cast(self._ns, ctypes.c_void_p)
        o.key_namespace_len = len(self.NAMESPACE)
        o.batch_concurrency = int(os.environ.get("DFKV_BATCH_CONCURRENCY", "1"))
        h = lib.dfkv_open_v2(ctypes.byref(o))
        if not h:
            raise RuntimeError(f"dfkv_open_v2 failed ({lib_path}, members {target})")
        self.h = h
        self.transport = (lib.dfkv_transport_mode(h) or b"").decode()

    def register(self, addr: int, n: int, mm: mmap.mmap) -> None:
        pass  # dfkv_register_memory is a no-op on TCP

    def _call(self, fn: Callable, keys: List[bytes], addrs: List[int], size: int) -> List[int]:
        n = len(keys)
        kb = [ctypes.create_string_buffer(k, len(k)) for k in keys]
        kp = (ctypes.c_void_p * n)(*[ctypes.addressof(b) for b in kb])
        kl = (ctypes.c_uint64 * n)(*[len(k) for k in keys])
        pp = (ctypes.c_void_p * n)(*addrs)
        sz = (ctypes.c_uint64 * n)(*([size] * n))
        out = (ctypes.c_int * n)()
        rc = fn(self.h, kp, kl, pp, sz, n, out)
        if rc != 0:
            return [0] * n
        return list(out)

    def put(self, keys: List[bytes], addrs: List[int], size: int) -> int:
        return sum(1 for x in self._call(self.lib.dfkv_batch_put, keys, addrs, size) if x)

    def get(self, keys: List[bytes], addrs: List[int], size: int) -> List[int]:
        # dfkv_get / dfkv_batch_get need the exact stored size: a hit is a full page
        return [size if x == 1 else -1 for x in self._call(self.lib.dfkv_batch_get, keys, addrs, size)]

    def close(self) -> None:
        self.lib.dfkv_close(self.h)


def mooncake_store(master: str, segment: int, local_buffer: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, local_buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    return s


class Mooncake:
    def __init__(self, target: str) -> None:
        # The bench client contributes no DRAM (segment 0): every object
        # lands on one of the storage processes.
        self.s = mooncake_store(target, 0, 64 << 20)

    def register(self, addr: int, n: int, mm: mmap.mmap) -> None:
        rc = self.s.register_buffer(addr, n)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer failed: {rc}")

    def put(self, keys: List[bytes], addrs: List[int], size: int) -> int:
        rs = self.s.batch_put_from([k.decode() for k in keys], addrs, [size] * len(keys))
        return sum(1 for r in rs if r == 0)

    def get(self, keys: List[bytes], addrs: List[int], size: int) -> List[int]:
        rs = self.s.batch_get_into([k.decode() for k in keys], addrs, [size] * len(keys))
        return [r if r >= 0 else -1 for r in rs]

    def close(self) -> None:
        try:
            self.s.close()
        except Exception:
            pass


BACKENDS = {"kvcellar": Kvcellar, "kvcellar-mem": Kvcellar, "dfkv": Dfkv, "mooncake": Mooncake}


# -- the workload ------------------------------------------------------------


def buffers(be, threads: int, nbytes: int) -> List[Tuple[mmap.mmap, mmap.mmap]]:
    """Per thread a source and a destination buffer of ``nbytes``, registered
    once for the whole run (Mooncake refuses overlapping registrations)."""
    bufs = []
    for _ in range(threads):
        src = mmap.mmap(-1, nbytes)
        dst = mmap.mmap(-1, nbytes)
        chunk = os.urandom(1 << 20)
        for off in range(0, nbytes, len(chunk)):
            src[off : off + len(chunk)] = chunk[: nbytes - off]
        for mm in (src, dst):
            be.register(buf_addr(mm), nbytes, mm)
        bufs.append((src, dst))
    return bufs


def measure(be, bufs, system: str, size: int, total: int, batch: int, prefix: str) -> List[dict]:
    threads = len(bufs)
    per_thread = max(1, -(-total // (size * batch * threads)))  # batches per thread

    def key(t: int, b: int, i: int) -> bytes:
        return f"{prefix}-{size}-{t}-{b}-{i}".encode()

    def stamp(t: int, b: int, i: int) -> bytes:
        return struct.pack("<Q", (((t << 24) | b) << 8 | i) + 1)

    results = []
    for op in ("put", "get"):
        done = [0] * threads
        bad: List[str] = []
        lat: List[float] = []
        barrier = threading.Barrier(threads + 1)

        def worker(t: int) -> None:
            src, dst = bufs[t]
            sa, da = buf_addr(src), buf_addr(dst)
            addrs_s = [sa + i * size for i in range(batch)]
            addrs_d = [da + i * size for i in range(batch)]
            mylat = []
            barrier.wait()
            for b in range(per_thread):
                keys = [key(t, b, i) for i in range(batch)]
                t0 = time.perf_counter()
                if op == "put":
                    for i in range(batch):
                        s = stamp(t, b, i)
                        src[i * size : i * size + 8] = s
                        src[(i + 1) * size - 8 : (i + 1) * size] = s
                    ok = be.put(keys, addrs_s, size)
                    done[t] += ok
                    if ok != batch and len(bad) < 5:
                        bad.append(f"put: {batch - ok} of {batch} failed (batch {b}, thread {t})")
                else:
                    lens = be.get(keys, addrs_d, size)
                    for i, n in enumerate(lens):
                        s = stamp(t, b, i)
                        if n != size:
                            if len(bad) < 5:
                                bad.append(f"get {keys[i].decode()}: length {n}")
                        elif dst[i * size : i * size + 8] != s or dst[(i + 1) * size - 8 : (i + 1) * size] != s:
                            if len(bad) < 5:
                                bad.append(f"get {keys[i].decode()}: wrong bytes")
                        else:
                            done[t] += 1
                mylat.append(time.perf_counter() - t0)
            lat.extend(mylat)

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in ts:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in ts:
            th.join()
        secs = time.perf_counter() - t0
        pages = per_thread * batch * threads
        lat.sort()
        results.append(
            {
                "system": system,
                "op": op,
                "size": size,
                "pages": pages,
                "ok": sum(done),
                "secs": secs,
                "gb_per_sec": sum(done) * size / secs / 1e9,
                "p50_ms": 1e3 * lat[len(lat) // 2],
                "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                "errors": bad,
                "ack": ACK[system],
            }
        )
    return results


def cmd_run(a) -> int:
    be = BACKENDS[a.system](a.target)
    rc = 0
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    bufs = buffers(be, a.threads, max(sizes) * a.batch)
    try:
        for size in sizes:
            for r in measure(be, bufs, a.system, size, parse_size(a.bytes), a.batch, a.prefix):
                r["run"] = a.run
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(
                    f"{r['system']:<13} {r['op']:<4} {r['size'] >> 10:>5} KiB: {r['gb_per_sec']:.3f} GB/s"
                    f"  batch p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms; {r['ok']}/{r['pages']} pages ok",
                    flush=True,
                )
                for e in r["errors"]:
                    print(f"  {e}", flush=True)
                if r["ok"] != r["pages"]:
                    rc = 1
    finally:
        be.close()
    return rc


def cmd_mooncake_serve(a) -> int:
    s = mooncake_store(a.master, parse_size(a.segment), 16 << 20)
    print("READY", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    try:
        s.close()
    except Exception:
        pass
    return 0


def cmd_table(a) -> int:
    rows = [json.loads(l) for l in open(a.results) if l.strip()]
    raw = {}
    if a.raw and os.path.exists(a.raw):
        for l in open(a.raw):
            if l.strip():
                j = json.loads(l)
                raw[j["size"]] = j
    order = ["kvcellar", "kvcellar-mem", "dfkv", "mooncake"]
    systems = [s for s in order if any(r["system"] == s for r in rows)]
    sizes = sorted({r["size"] for r in rows})

    def fmt_size(b: int) -> str:
        return f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"

    def med(system: str, op: str, size: int):
        v = [r["gb_per_sec"] for r in rows if r["system"] == system and r["op"] == op and r["size"] == size]
        return statistics.median(v) if v else None

    runs = len({r["run"] for r in rows})
    print(f"medians over {runs} run(s), GB/s (1e9 B/s); 4 threads, batches of 8, gets verified (length, first and last bytes)")
    head = f"{'system':<17} {'put acknowledged from':<40}" + "".join(
        f" {op + ' ' + fmt_size(s):>10}" for op in ("put", "get") for s in sizes
    )
    print(head)
    for sy in systems:
        cells = []
        for op in ("put", "get"):
            for s in sizes:
                m = med(sy, op, s)
                cells.append(f"{m:.3f}" if m is not None else "-")
        print(f"{sy:<17} {ACK[sy]:<40}" + "".join(f" {c:>10}" for c in cells))
    for sy in [s for s in ("kvcellar", "kvcellar-mem") if s in systems]:
        cells = []
        for op in ("put", "get"):
            for s in sizes:
                ours = med(sy, op, s)
                peers = [m for p in ("dfkv", "mooncake") if (m := med(p, op, s)) is not None]
                cells.append(f"{ours / max(peers):.2f}x" if ours and peers else "-")
        print(f"{sy + '/best':<17} {'(best of the peers measured)':<40}" + "".join(f" {c:>10}" for c in cells))
    if raw:
        cells = [" -"] * len(sizes) + [
            f"{raw[s]['raw_loopback_gb_per_sec']:.3f}" if s in raw and raw[s].get("raw_loopback_gb_per_sec") else "-"
            for s in sizes
        ]
        print(f"{'raw loopback':<17} {'(kvctl bench: plain TCP, same bytes)':<40}" + "".join(f" {c:>10}" for c in cells))
    errs = [(r["system"], r["op"], r["size"], r["run"], e) for r in rows for e in r.get("errors", [])]
    for sy, op, s, run, e in errs[:20]:
        print(f"ERROR {sy} {op} {fmt_size(s)} run {run}: {e}")
    for sy in systems:
        for op in ("put", "get"):
            for s in sizes:
                n = sum(1 for r in rows if r["system"] == sy and r["op"] == op and r["size"] == s)
                if n < runs:
                    print(f"MISSING {sy} {op} {fmt_size(s)}: {runs - n} of {runs} run(s) produced no figure (see the run's log)")
    for r in rows:
        if r["ok"] != r["pages"] and not r.get("errors"):
            print(f"ERROR {r['system']} {r['op']} {fmt_size(r['size'])} run {r['run']}: {r['pages'] - r['ok']} pages failed")
    return 0


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--system", required=True, choices=sorted(BACKENDS))
    r.add_argument("--target", required=True, help="kvcellar/dfkv: member list; mooncake: master host:port")
    r.add_argument("--sizes", default="64K,256K,1M,4M")
    r.add_argument("--bytes", default="512M", help="about this much per (size, op)")
    r.add_argument("--threads", type=int, default=4)
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--run", type=int, default=1)
    r.add_argument("--out", required=True, help="JSON lines are appended here")
    r.add_argument("--prefix", default=f"peers-{os.getpid()}-{int(time.time())}")
    m = sub.add_parser("mooncake-serve")
    m.add_argument("--master", required=True)
    m.add_argument("--segment", default="2G")
    t = sub.add_parser("table")
    t.add_argument("results")
    t.add_argument("--raw", default="")
    a = p.parse_args(argv)
    return {"run": cmd_run, "mooncake-serve": cmd_mooncake_serve, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
