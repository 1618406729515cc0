"""Round trip through libkvclient.so from Python (ctypes), against a real node,
with nothing installed: the package from the source tree, the library by path.

usage: python3 smoke_native.py LIBPATH MEMBERS
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "plugins"))


def main():
    lib, members = sys.argv[1], sys.argv[2]
    os.environ["KVCELLAR_LIB"] = lib
    import kvcellar
    from kvcellar import Client, Geometry, Status

    geo = Geometry(model_hash=20817, page_size=64, dtype_tag=3, tp_size=8, tp_rank=0,
                   layer_num=61, head_num=1, head_dim=576, mla=True)
    checks = 0

    def check(cond, what):
        nonlocal checks
        if not cond:
            raise SystemExit(f"FAIL: {what}")
        checks += 1
        print(f"ok: {what}")

    check(kvcellar.library_version() == kvcellar.__version__, "package and library versions agree")
    with Client(members, geometry=geo, options="io_timeout_ms=5000") as c:
        page = bytes((i * 13) & 0xFF for i in range(3 << 20))
        check(c.put("py-page", page) is Status.OK, "put 3 MiB")
        buf = bytearray(4 << 20)
        r = c.get("py-page", buf)
        check(r.ok and r.length == len(page) and buf[: r.length] == page, "get into a bytearray, no copy")
        check(c.exist("py-page") is Status.OK and c.exist("py-absent") is Status.MISS, "exist hit and miss")
        check(c.batch_exist(["py-page", "py-absent"]) == [Status.OK, Status.MISS], "batch exist")
        check("kvclient_ops_total" in c.stats(), "stats snapshot")
        with Client(members, geometry=Geometry(**{**geo.__dict__, "tp_rank": 3})) as c2:
            check(c2.get("py-page", buf).ok, "MLA page served to another tp_rank")
        with Client(members, geometry=Geometry(model_hash=1)) as c3:
            check(c3.get("py-page", buf).status is Status.MISMATCH, "another model: mismatch")
        check(c.delete("py-page") is Status.OK and c.exist("py-page") is Status.MISS, "delete")
    print(f"{checks} passed, 0 failed")


if __name__ == "__main__":
    main()
