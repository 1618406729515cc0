"""kvcellar.fingerprint: what changes a weights fingerprint and what does not
(standard library only; no engine, no cluster)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from kvcellar.fingerprint import TENSOR_WINDOWS, WINDOW, FingerprintError, weights_fingerprint

BIG = 256 << 10  # bytes of the large tensor: sampled, not hashed whole


def tensors(seed: int = 1):
    """name -> bytes: a small tensor (hashed whole) and a large one (sampled)."""
    return {
        "model.norm.weight": bytes((seed + i) % 251 for i in range(512)),
        "model.layers.0.self_attn.q_proj.weight": bytes((seed * 7 + i * 13) % 251 for i in range(BIG)),
    }


def write_safetensors(path: str, ts, dtype: str = "F16", metadata=None) -> None:
    header, data, at = {}, b"", 0
    for name, b in ts.items():
        header[name] = {"dtype": dtype, "shape": [len(b) // 2], "data_offsets": [at, at + len(b)]}
        data += b
        at += len(b)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def checkpoint(root: str, name: str, ts=None, config=None) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config or {"model_type": "llama", "num_hidden_layers": 2}, f)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors() if ts is None else ts)
    return d


def edited(offset: int, n: int = 3):
    """The default tensors with ``n`` bytes of the large one changed at ``offset``."""
    ts = tensors()
    big = bytearray(ts["model.layers.0.self_attn.q_proj.weight"])
    for i in range(n):
        big[offset + i] ^= 0x5A
    ts["model.layers.0.self_attn.q_proj.weight"] = bytes(big)
    return ts


def test_the_same_weights_anywhere_give_the_same_fingerprint(tmp_path):
    a = weights_fingerprint(checkpoint(str(tmp_path), "a"))
    b = weights_fingerprint(checkpoint(str(tmp_path), "elsewhere"))
    assert a == b and len(a) == 16 and int(a, 16) >= 0
    assert weights_fingerprint(checkpoint(str(tmp_path), "a")) == a  # stable


def test_a_few_bytes_of_one_tensor_change_it(tmp_path):
    base = weights_fingerprint(checkpoint(str(tmp_path), "base"))
    small = tensors()
    small["model.norm.weight"] = b"\xee" + small["model.norm.weight"][1:]
    assert weights_fingerprint(checkpoint(str(tmp_path), "small", small)) != base
    # In the large tensor: its first window, its last, and one in the middle.
    span = BIG - WINDOW
    for name, at in (("first", 10), ("last", BIG - 5), ("middle", span * 7 // (TENSOR_WINDOWS - 1) + 100)):
        n = 3 if name != "last" else 2
        assert weights_fingerprint(checkpoint(str(tmp_path), name, edited(at, n))) != base, name


def test_a_merged_low_rank_update_changes_it(tmp_path):
    """A merged LoRA adds a dense low-rank product: every element moves a little."""
    base = weights_fingerprint(checkpoint(str(tmp_path), "base"))
    ts = tensors()
    big = ts["model.layers.0.self_attn.q_proj.weight"]
    ts["model.layers.0.self_attn.q_proj.weight"] = bytes((b + (i // 64) % 2) % 256 for i, b in enumerate(big))
    assert weights_fingerprint(checkpoint(str(tmp_path), "merged", ts)) != base


def test_a_change_between_windows_is_not_seen(tmp_path):
    """The documented limit: bytes no window samples are not read."""
    base = weights_fingerprint(checkpoint(str(tmp_path), "base"))
    span = BIG - WINDOW
    gap = span // (TENSOR_WINDOWS - 1) // 2 + WINDOW  # between the first two windows
    assert weights_fingerprint(checkpoint(str(tmp_path), "between", edited(gap))) == base


def test_headers_sizes_names_and_config_change_it(tmp_path):
    base = weights_fingerprint(checkpoint(str(tmp_path), "base"))
    d = checkpoint(str(tmp_path), "bf16")
    write_safetensors(os.path.join(d, "model.safetensors"), tensors(), dtype="BF16")
    assert weights_fingerprint(d) != base
    d = checkpoint(str(tmp_path), "meta")
    write_safetensors(os.path.join(d, "model.safetensors"), tensors(), metadata={"format": "pt"})
    assert weights_fingerprint(d) != base
    longer = tensors()
    longer["model.norm.weight"] += b"\0\0"
    assert weights_fingerprint(checkpoint(str(tmp_path), "longer", longer)) != base
    d = checkpoint(str(tmp_path), "renamed")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    assert weights_fingerprint(d) != base
    assert weights_fingerprint(checkpoint(str(tmp_path), "cfg", config={"model_type": "llama"})) != base


def test_pickled_checkpoints_and_single_files(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    blob = bytes((i * 31) % 256 for i in range(3 << 20))
    (d / "pytorch_model.bin").write_bytes(blob)
    base = weights_fingerprint(str(d))
    (d / "pytorch_model.bin").write_bytes(blob[:100] + b"\xff" + blob[101:])  # in the first window
    assert weights_fingerprint(str(d)) != base
    # With both kinds, vLLM's default picks the safetensors, load_format pt the .bin.
    write_safetensors(str(d / "model.safetensors"), tensors())
    st, pt = weights_fingerprint(str(d)), weights_fingerprint(str(d), load_format="pt")
    assert st != pt and weights_fingerprint(str(d), load_format="safetensors") == st
    # A single file (a GGUF checkpoint) by its path.
    (tmp_path / "m.gguf").write_bytes(blob)
    assert len(weights_fingerprint(str(tmp_path / "m.gguf"))) == 16


def test_hub_ids_use_the_commit_the_cache_resolves(tmp_path, monkeypatch):
    for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    c1, c2 = "1" * 40, "2" * 40

    def ref(root, rev, commit, repo="models--org--m"):
        p = os.path.join(root, repo, "refs", rev)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(commit)

    with pytest.raises(FingerprintError, match="model_fingerprint"):
        weights_fingerprint("org/m")
    ref(str(tmp_path / "home" / ".cache" / "huggingface" / "hub"), "main", c1)
    main = weights_fingerprint("org/m")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    ref(str(tmp_path / "hfhome" / "hub"), "main", c1)
    assert weights_fingerprint("org/m") == main  # the same commit wherever the cache is
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    ref(str(tmp_path / "hubcache"), "main", c2)
    ref(str(tmp_path / "hubcache"), "v1.0", c1)
    assert weights_fingerprint("org/m") != main  # HF_HUB_CACHE first: another commit
    assert weights_fingerprint("org/m", revision="v1.0") == main
    assert weights_fingerprint("org/m", revision=c1) == main  # a commit is used as it is
    ref(str(tmp_path / "dl"), "main", c1)
    assert weights_fingerprint("org/m", download_dir=str(tmp_path / "dl")) == main  # vLLM's --download-dir first
    with pytest.raises(FingerprintError, match="revision 'nope'.*model_fingerprint"):
        weights_fingerprint("org/m", revision="nope")
    assert weights_fingerprint("org/other", revision=c1) != main


def test_dummy_weights_are_named_by_the_config_alone(tmp_path):
    d = tmp_path / "cfg-only"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    dummy = weights_fingerprint(str(d), load_format="dummy")
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "config.json").write_text('{"model_type": "llama"}')
    assert weights_fingerprint(str(twin), load_format="dummy") == dummy
    (twin / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')
    assert weights_fingerprint(str(twin), load_format="dummy") != dummy
    real = checkpoint(str(tmp_path), "real", config={"model_type": "llama"})
    assert weights_fingerprint(real, load_format="dummy") == dummy  # weights not read
    assert weights_fingerprint(real) != dummy  # never shared with real weights
    assert weights_fingerprint("org/m", load_format="dummy") != dummy  # no hub cache needed


def test_what_cannot_be_fingerprinted_is_one_clear_error(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(FingerprintError, match="no weight files.*model_fingerprint"):
        weights_fingerprint(str(d))
    for bad in (b"\x05\0\0", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 2) + b"[]",
                struct.pack("<Q", 9) + b"not json!",
                struct.pack("<Q", 44) + b'{"t":{"dtype":"F16","data_offsets":[0,99]}} '):
        (d / "model.safetensors").write_bytes(bad)
        with pytest.raises(FingerprintError, match="not a safetensors file"):
            weights_fingerprint(str(d))
    with pytest.raises(FingerprintError, match="neither a local path nor"):
        weights_fingerprint("s3://bucket/model")
    with pytest.raises(FingerprintError, match="no model"):
        weights_fingerprint("")
    from kvcellar.config import ConfigError

    assert issubclass(FingerprintError, ConfigError)  # the plugins' bad-configuration error


def test_imports_without_torch():
    code = "import sys, kvcellar.fingerprint; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
