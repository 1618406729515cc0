"""Where a unit's bytes live in vLLM's paged KV cache: per layer, each
block as raw host segments in a canonical byte order (the zero-copy path),
and the copies through host memory for a cache in device memory (the
staged path, same byte order). docs/plugins/vllm.md, "What is stored"."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

#: Host memory a staged (GPU) load or save uses at once.
STAGE_BYTES = 256 << 20


class LayerSegments:
    """Where each vLLM block of one layer lives, as raw host segments, in a
    canonical byte order.

    vLLM gives each layer a ``[kernel blocks, heads, tokens, content]`` view
    whose strides follow the cache layout; a vLLM block may span ``k``
    kernel blocks (an attention backend with smaller blocks). A block's
    bytes are ordered as the layout orders one unsplit block (its dims by
    stride, the token dim as kernel-block-major then token), so a
    deployment that splits blocks and one that does not store the same
    bytes; a run of dims dense in memory is one segment.
    """

    def __init__(self, view: Any, num_blocks: int, block_size: int) -> None:
        kb = int(view.shape[0])
        if num_blocks <= 0 or kb % num_blocks:
            raise ValueError(f"{kb} kernel blocks for {num_blocks} blocks")
        k = kb // num_blocks
        if int(view.shape[2]) * k != block_size:
            raise ValueError(f"{k} kernel blocks of {int(view.shape[2])} tokens are not a {block_size}-token block")
        self.view = view
        self.k = k
        es = int(view.element_size())
        self.base = int(view.data_ptr())
        self.block_stride = int(view.stride(0)) * k * es
        # (dim of the view, size, stride) in the canonical order; dim 0 is
        # the kernel block, placed just outside the token dim (2).
        order = sorted((1, 2, 3), key=lambda d: -int(view.stride(d)))
        dims: List[Tuple[int, int, int]] = []
        for d in order:
            if d == 2:
                dims.append((0, k, int(view.stride(0))))
            dims.append((d, int(view.shape[d]), int(view.stride(d))))
        self.order = [d for d, _, _ in dims]  # for staging: the permutation of a [k, H, n, C] slice
        live = [(sz, st) for _, sz, st in dims if sz > 1]
        run = 1
        while live and live[-1][1] == run:
            run *= live.pop()[0]
        if run == 1 and live:
            raise ValueError("the KV cache view has no contiguous innermost dimension")
        offsets = [0]
        for sz, st in live:
            offsets = [o + i * st for o in offsets for i in range(sz)]
        runs: List[Tuple[int, int]] = []
        for o in offsets:  # adjacent runs of one block: one segment
            if runs and runs[-1][0] + runs[-1][1] == o * es:
                runs[-1] = (runs[-1][0], runs[-1][1] + run * es)
            else:
                runs.append((o * es, run * es))
        self.runs = runs
        self.block_bytes = sum(n for _, n in runs)

    def block(self, block_id: int, out_addrs: List[int], out_sizes: List[int]) -> None:
        base = self.base + block_id * self.block_stride
        for off, n in self.runs:
            a = base + off
            if out_addrs and out_addrs[-1] + out_sizes[-1] == a:
                out_sizes[-1] += n  # adjacent in memory: one segment
            else:
                out_addrs.append(a)
                out_sizes.append(n)


class Scratch:
    """Where a load reads the bytes of blocks it skips (vLLM computed them
    locally): a buffer of its own per load in flight, made for the load and
    dropped when its call returned, each skipped block of each layer at its
    own offset. The library refuses overlapping output segments, and a
    unit's skipped blocks are fewer than its blocks, so a load's buffer is
    under a unit's bytes times its units with skips (at most one: only the
    first unit of a load can start inside a unit)."""

    def get(self, nbytes: int) -> Any:
        import torch

        return torch.empty(max(1, nbytes), dtype=torch.uint8)


def units_segments(
    layers: Sequence[LayerSegments], units: Sequence[Sequence[int]], scratch: Scratch
) -> Tuple[List[int], List[int], List[int], Any]:
    """(addresses, sizes, per-unit counts, scratch keepalive) of units'
    segments: layer by layer, its blocks in order; a skipped block (-1)
    reads into its own region of the calling thread's scratch. Each unit's
    list is its own (segments merge within a unit only)."""
    skipped = sum(1 for blocks in units for b in blocks if b < 0)
    buf = scratch.get(skipped * sum(lay.block_bytes for lay in layers)) if skipped else None
    at = int(buf.data_ptr()) if buf is not None else 0
    addrs: List[int] = []
    sizes: List[int] = []
    counts: List[int] = []
    for blocks in units:
        ua: List[int] = []
        us: List[int] = []
        for lay in layers:
            for b in blocks:
                if b < 0:
                    ua.append(at)
                    us.append(lay.block_bytes)
                    at += lay.block_bytes
                else:
                    lay.block(b, ua, us)
        addrs += ua
        sizes += us
        counts.append(len(ua))
    return addrs, sizes, counts, buf


# -- staging (a cache in device memory) ----------------------------------------------------


def stage_chunks(n: int, unit_bytes: int) -> List[Tuple[int, int]]:
    """Unit ranges of at most STAGE_BYTES of host buffers each (one unit at
    least): what a long prompt pins at once stays bounded."""
    per = max(1, STAGE_BYTES // max(1, unit_bytes))
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def stage_buffer(unit_bytes: int) -> Any:
    import torch

    return torch.empty(unit_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _kernel_index(lay: LayerSegments, blocks: Sequence[int]) -> Any:
    import torch

    ids = [b * lay.k + j for b in blocks for j in range(lay.k)]
    return torch.tensor(ids, dtype=torch.long, device=lay.view.device)


def stage_out(layers: Sequence[LayerSegments], blocks: Sequence[int], unit_bytes: int) -> Any:
    """A unit copied into one (pinned) host buffer, in the byte order of the
    zero-copy path."""
    buf = stage_buffer(unit_bytes)
    at = 0
    for lay in layers:
        v = lay.view
        sel = v.index_select(0, _kernel_index(lay, blocks))
        sel = sel.view(len(blocks), lay.k, *v.shape[1:]).permute(0, *[d + 1 for d in lay.order])
        n = lay.block_bytes * len(blocks)
        buf[at : at + n].view(v.dtype).view(sel.shape).copy_(sel)
        at += n
    for lay in layers[:1]:
        _sync(lay.view.device)
    return buf if at == buf.numel() else buf[:at]


def stage_in(layers: Sequence[LayerSegments], buf: Any, blocks: Sequence[int]) -> None:
    """The inverse of :func:`stage_out` for a unit's loaded bytes; skipped
    blocks (-1) are not written."""
    keep = [i for i, b in enumerate(blocks) if b >= 0]
    if not keep:
        return
    at = 0
    for lay in layers:
        v = lay.view
        n = lay.block_bytes * len(blocks)
        shape = [len(blocks)] + [lay.k if d == 0 else int(v.shape[d]) for d in lay.order]
        t = buf[at : at + n].view(v.dtype).view(shape)[keep]
        inverse = [0] * 4
        for pos, d in enumerate(lay.order):
            inverse[d] = pos + 1
        t = t.permute(0, *inverse).reshape(len(keep) * lay.k, *v.shape[1:])
        v.index_copy_(0, _kernel_index(lay, [blocks[i] for i in keep]), t.to(v.device))
        at += n
    for lay in layers[:1]:
        _sync(lay.view.device)
