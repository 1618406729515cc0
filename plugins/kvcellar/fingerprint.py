"""A fingerprint of a model's weights, for page identity.

Two engines that name their model alike but load other weights (a
fine-tune saved under the base model's name, a merged LoRA, a re-upload)
compute other KV for the same tokens. A plugin folds
:func:`weights_fingerprint` into its page identity so that they miss
instead of serving each other's pages. Standard library only: it imports
without torch or any engine, and it reads no weights into memory.

What it covers, by what names the model:

- **A local directory.** The weight files at its top level
  (``*.safetensors`` when there are any, else ``*.bin``, ``*.pt``,
  ``*.pth``, ``*.gguf``; a ``load_format`` naming one kind takes that kind
  only: ``safetensors``, ``pt``, ``gguf``), and ``config.json``. Files a
  loader would skip are hashed too: that can only tell more apart. For each weight file: its name and
  size, and for ``.safetensors`` its header (tensor names, dtypes, shapes,
  offsets, metadata) and a sample of every tensor's bytes: a tensor of at
  most 64 KiB whole, a larger one as 16 windows of 4 KiB spread evenly
  over its data (the first and the last 4 KiB among them). Other files:
  the whole file up to 1 MiB, else 64 windows of 4 KiB, or one per 64 MiB
  when that is more, spread evenly.
- **A single weight file** (a ``.gguf``): the same as one file of a
  directory.
- **A Hugging Face hub id** (``org/name``): the commit the local hub cache
  resolves ``revision`` (default ``main``) to, read from
  ``models--org--name/refs/<revision>`` under ``download_dir``, then
  ``HF_HUB_CACHE``, ``HF_HOME/hub``, ``~/.cache/huggingface/hub``; no
  network. A commit is immutable, so it names the weights. A ``revision``
  that is itself a 40-hex commit is used as it is.
- ``load_format="dummy"``: the engine makes up its weights at start, so no
  file names them. The fingerprint is the literal ``dummy`` and the
  model's configuration (``config.json`` of a directory, else the id and
  revision): dummy instances of one configuration share pages with each
  other (benchmarks of the cache work), never with an instance that loads
  real weights.

Anything else (an object-store URI, a directory without weight files, a
hub id the cache does not hold) raises :class:`FingerprintError`, which
says to set the plugin's ``model_fingerprint`` option: any text that names
these weights, the same on every instance that serves them.

The limit, honestly: the sample sees every change to a file's size or a
safetensors header, every change to a tensor of at most 64 KiB, and every
change that touches at least one sampled window. A merged LoRA, a
fine-tune or a requantization changes nearly every element of the tensors
it touches (a low-rank update is dense), so every window of those tensors
changes. A change confined to bytes between the windows of large tensors
(a few rows of one embedding, a hand edit of single values) is not seen:
set ``model_fingerprint`` for weights that differ only that way. The cost
is about 64 KiB read per large tensor (some 50 MB for a 70B model), done
once when a plugin starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Iterable, List, Optional, Tuple

from kvcellar.config import ConfigError

__all__ = ["FingerprintError", "weights_fingerprint"]

#: Bytes of one sampled window.
WINDOW = 4096
#: Windows per large safetensors tensor (the first and last among them).
TENSOR_WINDOWS = 16
#: A tensor at most this large is hashed whole.
SMALL_TENSOR = 64 << 10
#: A non-safetensors weight file at most this large is hashed whole.
SMALL_FILE = 1 << 20
#: Windows per other weight file: at least this many, or one per FILE_STRIDE.
FILE_WINDOWS = 64
FILE_STRIDE = 64 << 20
#: The safetensors format's own bound on the JSON header.
MAX_HEADER = 100 << 20

SAFETENSORS = (".safetensors",)
PICKLED = (".bin", ".pt", ".pth")
OTHER = (".gguf",)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_DIGITS = 16


class FingerprintError(ConfigError):
    """The weights cannot be fingerprinted; the message says why and to set
    ``model_fingerprint``."""


def _fail(model: str, why: str) -> FingerprintError:
    return FingerprintError(
        f"cannot fingerprint the weights of {model!r}: {why}; set the 'model_fingerprint' option "
        "(any text naming these weights, the same on every instance that serves them)"
    )


def weights_fingerprint(
    model: str,
    revision: Optional[str] = None,
    load_format: Optional[str] = None,
    download_dir: Optional[str] = None,
) -> str:
    """A short hex digest naming the weights ``model`` refers to (see the
    module docs for what it reads and its limit)."""
    if not isinstance(model, str) or not model:
        raise _fail(str(model), "no model path or id given")
    fmt = str(load_format or "auto").lower()
    h = hashlib.sha256(b"kvcellar-weights/v1\0")
    if fmt == "dummy":
        h.update(b"dummy\0")
        cfg = os.path.join(model, "config.json")
        if os.path.isfile(cfg):
            with open(cfg, "rb") as f:
                h.update(f.read())
        else:
            h.update(f"{model}\0{revision or ''}".encode())
        return h.hexdigest()[:_DIGITS]
    if os.path.isdir(model):
        files = _weight_files(model, fmt)
        if not files:
            raise _fail(model, f"the directory holds no weight files for load_format {fmt!r}")
        h.update(b"dir\0")
        cfg = os.path.join(model, "config.json")
        if os.path.isfile(cfg):
            with open(cfg, "rb") as f:
                h.update(b"config.json\0" + f.read())
        for name in files:
            _hash_file(h, os.path.join(model, name), name)
        return h.hexdigest()[:_DIGITS]
    if os.path.isfile(model):
        h.update(b"file\0")
        _hash_file(h, model, os.path.basename(model))
        return h.hexdigest()[:_DIGITS]
    commit = _hub_commit(model, revision, download_dir)
    h.update(f"hub\0{model}\0{commit}".encode())
    return h.hexdigest()[:_DIGITS]


# -- local files ------------------------------------------------------------------


def _weight_files(d: str, fmt: str) -> List[str]:
    names = sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
    st = [n for n in names if n.endswith(SAFETENSORS)]
    pk = [n for n in names if n.endswith(PICKLED)]
    if fmt in ("safetensors", "fastsafetensors", "mistral", "sharded_state"):
        return st
    if fmt in ("pt", "npcache"):
        return pk
    if fmt == "gguf":
        return [n for n in names if n.endswith(OTHER)]
    return st or pk or [n for n in names if n.endswith(OTHER)]


def _hash_file(h: "hashlib._Hash", path: str, name: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if name.endswith(SAFETENSORS):
            header = _safetensors_header(f, path, size)
            h.update(header)
            for lo, hi in _tensor_ranges(header, path, size):
                _hash_range(h, f, lo, hi, SMALL_TENSOR, TENSOR_WINDOWS)
        else:
            _hash_range(h, f, 0, size, SMALL_FILE, max(FILE_WINDOWS, size // FILE_STRIDE))


def _safetensors_header(f, path: str, size: int) -> bytes:
    """The raw JSON header: an 8-byte little-endian length, then that many bytes."""
    head = f.read(8)
    if len(head) != 8:
        raise _fail(path, "not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > MAX_HEADER or 8 + n > size:
        raise _fail(path, f"not a safetensors file (header length {n} for a {size}-byte file)")
    raw = f.read(n)
    if len(raw) != n:
        raise _fail(path, "not a safetensors file (its header is cut short)")
    return raw


def _tensor_ranges(raw: bytes, path: str, size: int) -> List[Tuple[int, int]]:
    """Every tensor's absolute [begin, end) byte range, in file order."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise _fail(path, f"not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise _fail(path, "not a safetensors file (its header is not a JSON object)")
    base = 8 + len(raw)
    out: List[Tuple[int, int]] = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if (
            not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offs)
            or not 0 <= offs[0] <= offs[1] or base + offs[1] > size
        ):
            raise _fail(path, f"not a safetensors file (tensor {name!r} has data_offsets {offs!r})")
        out.append((base + offs[0], base + offs[1]))
    out.sort()
    return out


def _windows(lo: int, hi: int, small: int, count: int) -> Iterable[Tuple[int, int]]:
    """[lo, hi) whole when at most ``small`` bytes, else ``count`` windows of
    WINDOW bytes, evenly spaced, the first at ``lo`` and the last ending at ``hi``."""
    n = hi - lo
    if n <= small:
        yield lo, n
        return
    span = n - WINDOW
    for i in range(count):
        yield lo + span * i // (count - 1), WINDOW


def _hash_range(h: "hashlib._Hash", f, lo: int, hi: int, small: int, count: int) -> None:
    for at, n in _windows(lo, hi, small, count):
        f.seek(at)
        data = f.read(n)
        if len(data) != n:
            raise _fail(getattr(f, "name", "?"), "the file changed while it was read")
        h.update(data)


# -- the hub cache ------------------------------------------------------------------


def _hub_roots(download_dir: Optional[str]) -> List[str]:
    roots = []
    if download_dir:
        roots.append(download_dir)
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        roots.append(env)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    roots.append(os.path.join(home, "hub"))
    return roots


def _hub_commit(model: str, revision: Optional[str], download_dir: Optional[str]) -> str:
    if not _HUB_ID.match(model):
        raise _fail(model, "it is neither a local path nor a Hugging Face hub id")
    rev = revision or "main"
    if _COMMIT.match(rev):
        return rev  # a commit names its files whatever the cache holds
    repo = "models--" + model.replace("/", "--")
    looked = []
    for root in _hub_roots(download_dir):
        ref = os.path.join(root, repo, "refs", *rev.split("/"))
        looked.append(ref)
        try:
            with open(ref) as f:
                commit = f.read().strip()
        except OSError:
            continue
        if _COMMIT.match(commit):
            return commit
    raise _fail(model, f"the hub cache holds no commit for revision {rev!r} (looked at {', '.join(looked)})")
