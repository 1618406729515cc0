"""kvcellar._native against client-ffi/include/kvclient.h: the ctypes
structs, constants, status codes and function list are written by hand, so
a C compiler checks them here (sizes, field offsets, values, arity)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from kvcellar import _native
from kvcellar.client import Status

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "client-ffi", "include", "kvclient.h")


def header_text() -> str:
    with open(HEADER) as f:
        return f.read()


def c_facts(tmp_path) -> dict:
    """Sizes, offsets and constants as a C compiler sees them."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    fields = [name for name, _ in _native.Geometry._fields_]
    consts = re.findall(r"^#define (KV_[A-Z_]+) ", header_text(), flags=re.M)
    lines = [
        '#include <stdio.h>', '#include <stddef.h>', f'#include "{os.path.abspath(HEADER)}"', "int main(void) {",
        'printf("sizeof_geometry %zu\\n", sizeof(kv_geometry));',
        'printf("sizeof_iovec %zu\\n", sizeof(kv_iovec));',
        'printf("offset_iovec_len %zu\\n", offsetof(kv_iovec, len));',
    ]
    lines += [f'printf("offset_{f} %zu\\n", offsetof(kv_geometry, {f}));' for f in fields]
    lines += [f'printf("{c} %lld\\n", (long long)({c}));' for c in consts]
    lines += ["return 0; }"]
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_structs_and_constants_match_the_header(tmp_path):
    facts = c_facts(tmp_path)
    assert ctypes.sizeof(_native.Geometry) == facts["sizeof_geometry"]
    for name, _ in _native.Geometry._fields_:
        assert getattr(_native.Geometry, name).offset == facts[f"offset_{name}"], name
    assert ctypes.sizeof(_native.IoVec) == facts["sizeof_iovec"]
    assert _native.IoVec.len.offset == facts["offset_iovec_len"]
    assert _native.FLAG_MLA == facts["KV_FLAG_MLA"]
    assert _native.MAX_ITEM_IOVCNT == facts["KV_MAX_ITEM_IOVCNT"]
    assert _native.MAX_BATCH_ITEMS == facts["KV_MAX_BATCH_ITEMS"]
    # Every status code of the header, by name and value, and no other.
    codes = {k[3:]: v for k, v in facts.items() if k.startswith("KV_") and not k.startswith(("KV_MAX", "KV_FLAG"))}
    assert {s.name: int(s) for s in Status} == codes
    m = re.search(r"Keys are NUL-terminated strings of 1\.\.=(\d+) bytes", header_text())
    assert m and int(m.group(1)) == _native.MAX_KEY_LEN


def test_every_function_of_the_header_is_declared_with_its_arity():
    protos = {}
    text = re.sub(r"/\*.*?\*/", "", header_text(), flags=re.S)
    for m in re.finditer(r"\b(kv_[a-z_]+)\s*\(([^)]*)\)\s*;", text):
        args = m.group(2).strip()
        protos[m.group(1)] = 0 if args in ("", "void") else args.count(",") + 1
    assert set(protos) == set(_native._SIGNATURES), "functions differ between kvclient.h and _native"
    for name, n in protos.items():
        assert len(_native._SIGNATURES[name][1]) == n, name
