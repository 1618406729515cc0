"""Round trip through libkvclient.so from Python (ctypes), against a real node.

usage: python3 smoke_native.py LIBPATH MEMBERS
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "plugins"))

from kvcellar import _native as kv  # noqa: E402


def main():
    lib, members = sys.argv[1], sys.argv[2]
    geo = dict(model_hash=20817, page_size=64, dtype_tag=3, tp_size=8, tp_rank=0,
               layer_num=61, head_num=1, head_dim=576, flags=kv.KV_FLAG_MLA)
    checks = 0

    def check(cond, what):
        nonlocal checks
        if not cond:
            raise SystemExit(f"FAIL: {what}")
        checks += 1
        print(f"ok: {what}")

    with kv.Client(members, geo, "io_timeout_ms=5000", lib_path=lib) as c:
        page = bytes((i * 13) & 0xFF for i in range(3 << 20))
        check(c.put("py-page", page) == kv.KV_OK, "put 3 MiB")
        buf = bytearray(4 << 20)
        s, n = c.get("py-page", buf)
        check(s == kv.KV_OK and n == len(page) and buf[:n] == page, "get into a bytearray, no copy")
        check(c.exist("py-page") == kv.KV_OK, "exist")
        check(c.exist("py-absent") == kv.KV_MISS, "exist miss")
        small = bytearray(10)
        check(c.get("py-page", small) == (kv.KV_TOO_SMALL, len(page)), "too small reports the size needed")
        check(c.batch_exist(["py-page", "py-absent"]) == [kv.KV_OK, kv.KV_MISS], "batch exist")
        check("kvclient_ops_total" in c.stats(), "stats snapshot")
        # No MDS listens on port 1: unavailable, and the static ring stays in use.
        check(c.start_mds_discovery("127.0.0.1:1", "g", 100) == kv.KV_UNAVAILABLE, "discovery without an MDS")
        check(c.exist("py-page") == kv.KV_OK, "static ring still in use")
        check(c.epoch() == 1, "epoch")
        # A read-only view that is not bytes (copied once, kept alive).
        view = memoryview(page)[1000:5096]
        check(c.put("py-view", view) == kv.KV_OK, "put a memoryview slice")
        got = bytearray(4096)
        check(c.get("py-view", got) == (kv.KV_OK, 4096) and got == page[1000:5096], "the slice's bytes, exactly")
        check(c.get("py-view", bytearray()) == (kv.KV_TOO_SMALL, 4096), "empty buffer: a size probe")
        try:
            c.put("a\0b", b"x")
            check(False, "a key with NUL refused")
        except ValueError:
            check(True, "a key with NUL refused")
        # An MLA page is served to every TP rank.
        other_rank = dict(geo, tp_rank=3)
        with kv.Client(members, other_rank, lib_path=lib) as c2:
            buf2 = bytearray(4 << 20)
            s, n = c2.get("py-page", buf2)
            check(s == kv.KV_OK and n == len(page) and buf2[:n] == page, "MLA page served to another tp_rank")
        with kv.Client(members, dict(geo, model_hash=1), lib_path=lib) as c3:
            check(c3.get("py-page", buf)[0] == kv.KV_MISMATCH, "another model: mismatch")
    try:
        kv.Client(members, geo, "bogus=1", lib_path=lib)
        check(False, "bad option refused")
    except kv.KvError as e:
        check("unknown option" in str(e), f"bad option refused: {e}")
    print(f"{checks} passed, 0 failed")


if __name__ == "__main__":
    main()
