"""Parse, split and merge llama.cpp per-sequence KV states. Pure: bytes in, bytes out, no llama_cpp.

Why this exists: a chained block (text B learned on top of block A) holds, in a full capture, every
cell of A again. Storing only B's new cells plus a reference to A saves that repeated prefix on
disk; at restore the full state is rebuilt from A's bytes and B's delta, byte for byte.

The layout parsed here is what llama.cpp's memory modules write for ONE sequence
(``llama_state_seq_get_data``, vendored llama.cpp of llama-cpp-python 0.3.36), all integers
little-endian. A state starts with ``u32 magic (0xaf143cd8), i32 seq_id`` (written by
``llama_context::state_seq_get_data``) and then holds one *section* per memory module, in the order
the model's memory writes them. This module is the one place that knows them, per memory kind:

* **attention** (``llama_kv_cache``: a dense model, an MoE, DeepSeek's latent attention): one KV section;
* **sliding window** (``llama_kv_cache_iswa``: Gemma 3, GPT-OSS): the full-attention KV section, then
  the sliding-window one, which holds only the cells its last position still sees;
* **recurrent** (``llama_memory_recurrent``: Mamba, Mamba-2): one recurrent section;
* **hybrid** (``llama_memory_hybrid``: Qwen 3.5 / Qwen3-Next, Granite 4, Nemotron-H, LFM2): the KV
  section of the attention layers, then the recurrent section of the other layers.

A KV section (`Section`)::

    u32 n_stream                                  (1: a context with n_seq_max = 1)
    u32 cell_count
    cell_count x meta: i32 pos, u32 n_seq_id (=1), [ext: i32 x, i32 y, i32 tok], i32 seq_id
                                                  (ext records only on M-RoPE / PLE models: Qwen 3.5)
    u32 v_trans, u32 n_layer
    n_layer x K: i32 type, u64 row_size, cell_count * row_size bytes       (row = one cell)
    V, if v_trans == 0: n_layer x (i32 type, u64 row_size, cell_count * row_size bytes)
    V, if v_trans == 1: n_layer x (i32 type, u32 el_size, u32 n_embd,
                                   n_embd x (cell_count * el_size bytes))  (column = one cell)
    (no V at all with latent attention, MLA: the K row is the compressed latent V is read out of)

A recurrent section (`RecurrentSection`): the state AFTER the last position, one cell::

    u32 cell_count                                (1)
    cell_count x meta: i32 pos (the last position), u32 n_seq_id (=0: written for one sequence)
    u32 s_trans (=0), u32 n_layer                 (every layer of the model, recurrent or not)
    k x R: i32 type, u64 row_size, cell_count * row_size bytes   (the convolution window)
    k x S: i32 type, u64 row_size, cell_count * row_size bytes   (the SSM / delta-net state; LFM2's
                                                                  short convolutions: row_size 0)

The headers do not say which optional parts follow (cell ext records, V, how many of the ``n_layer``
layers are recurrent), so `parse_state()` tries each reading of a section and keeps the one under
which the whole buffer parses exactly, section after section to its end; a recurrent section is
always the last one (tests/test_architectures.py parses llama.cpp's own bytes of every kind).

Cells of a KV section are written in cell-index order, and the sliding-window cache writes only the
cells its last position still sees. Both facts matter for splitting: a child's full state is, per KV
section, a *suffix* of the parent's cells (all of them for full attention, the ones still in the window
for SWA) followed by the child's new cells; a recurrent section is *replaced* by the child's (the
state after the child's last token, into which the parent's only fed). `split()` checks that this
decomposition holds on the positions before returning a delta, and the caller must check
``merge(parent, delta) == full`` on the real bytes before trusting it (``Memory.learn`` does, and
stores the full state otherwise).

What no recurrent state allows: `cut()` to a shorter prefix (the state of an earlier position was
overwritten by the later tokens) and `join()`; both raise `StateLayoutError` naming the recurrent
section.

Layouts this parser refuses (it raises `StateLayoutError`, and the caller stores the full
state): several streams, cells shared by several sequences, a transposed recurrent state, a PLE
history row, trailing bytes, and anything that does not add up to the buffer length.

The delta encoding (ours, versioned by its magic)::

    8s  b"GMDELTA1"
    u32 n_sections
    n_sections x u32 n_keep      cells kept from the END of the parent's section, in order (0 for a
                                 recurrent section: the child's replaces it)
    the child's new cells, encoded as a llama per-sequence state (the same sections, fewer cells; a
    recurrent section whole)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["StateLayoutError", "Section", "RecurrentSection", "parse_state", "layout", "encode_state", "split", "merge",
           "DELTA_MAGIC", "delta_sizes", "place_cells", "place_cells_into", "needs_placing", "join",
           "cut", "cuttable"]

DELTA_MAGIC = b"GMDELTA1"
_IO_MAGIC = 0xAF143CD8  # llama-context.cpp: io_magic
_META = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])  # 12 bytes per cell
#: a cell with an ext record (M-RoPE's 2-D position, PLE's token id): 24 bytes
_META_EXT = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"),
                      ("seq_id", "<i4")])
_RMETA = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4")])  # a recurrent cell written for one sequence


class StateLayoutError(ValueError):
    """The bytes are not a per-sequence state of the layout described in this module."""


@dataclass
class _Layer:
    """One layer's K (or V) of one section: a 2-D uint8 array ``[cells, row]`` or, for transposed
    V, a 3-D array ``[n_embd, cells, el_size]``."""

    type: int
    unit: int  # row_size for rows, el_size for transposed V
    data: np.ndarray
    n_embd: int = 0  # transposed V only


class _Cells:
    """What every section says of its cells, from its structured ``meta`` array (one row a cell)."""

    meta: np.ndarray

    @property
    def n_cells(self) -> int:
        return int(self.meta.shape[0])

    @property
    def positions(self) -> np.ndarray:
        return self.meta["pos"]


@dataclass
class Section(_Cells):
    """One KV cache's cells for one sequence: positions, raw meta, and per-layer K/V bytes."""

    meta: np.ndarray  # structured _META array, one per cell
    v_trans: bool = False
    k: list[_Layer] = field(default_factory=list)
    v: list[_Layer] = field(default_factory=list)

    kind = "kv"

    @property
    def ext(self) -> bool:
        """Whether the cells carry ext records (M-RoPE / PLE models)."""
        return self.meta.dtype == _META_EXT

    def take(self, sl: slice) -> "Section":
        """The cells ``sl`` (a slice over cell order) of this section."""
        return Section(meta=self.meta[sl], v_trans=self.v_trans,
                       k=[_Layer(l.type, l.unit, l.data[sl]) for l in self.k],
                       v=[_Layer(l.type, l.unit, l.data[:, sl] if self.v_trans else l.data[sl], l.n_embd)
                          for l in self.v])


@dataclass
class RecurrentSection(_Cells):
    """A recurrent memory's state for one sequence: the cell of its last position and, per recurrent
    layer, the R (convolution window) and S (SSM / delta-net state) rows of that cell. It is the state
    AFTER that position and nothing of earlier ones: it cannot be cut to a shorter prefix."""

    meta: np.ndarray  # structured _RMETA array (one cell for one sequence)
    n_layer: int      # the header's layer count: every layer of the model, recurrent or not
    r: list[_Layer] = field(default_factory=list)
    s: list[_Layer] = field(default_factory=list)
    kind = "recurrent"


class _Reader:
    def __init__(self, buf: "memoryview | bytes | np.ndarray") -> None:
        self.arr = np.frombuffer(buf, dtype=np.uint8)
        self.off = 0

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.off + n > self.arr.size:
            raise StateLayoutError(f"state ends at byte {self.arr.size}, needed {self.off + n}")
        out = self.arr[self.off:self.off + n]
        self.off += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        s = struct.Struct(fmt)
        return s.unpack(self.take(s.size).tobytes())


def _parse_kv(r: _Reader, ext: bool, has_v: bool) -> Section:
    """One KV section, read as having cell ext records (``ext``) and V layers after the K ones (``has_v``)."""
    (n_stream,) = r.unpack("<I")
    if n_stream != 1:
        raise StateLayoutError(f"{n_stream} streams: only single-stream caches are split")
    (cells,) = r.unpack("<I")
    dt = _META_EXT if ext else _META
    if cells == 0:
        return Section(meta=np.zeros(0, dtype=dt))
    meta = r.take(cells * dt.itemsize).view(dt)
    if np.any(meta["n_seq_id"] != 1) or np.any(meta["seq_id"] != 0):
        raise StateLayoutError("cells with several sequences (or cell ext records read as such): not split")
    if cells > 1 and np.any(np.diff(meta["pos"]) <= 0):
        raise StateLayoutError("cell positions are not strictly increasing in cell order")
    v_trans, n_layer = r.unpack("<II")
    if v_trans not in (0, 1) or not 0 < n_layer < 4096:
        raise StateLayoutError(f"implausible v_trans={v_trans} n_layer={n_layer}")
    sec = Section(meta=meta, v_trans=bool(v_trans))
    for _ in range(n_layer):
        ktype, row = r.unpack("<iQ")
        if not 0 <= ktype < 256 or row == 0:
            raise StateLayoutError(f"implausible K layer (type {ktype}, row {row} bytes)")
        sec.k.append(_Layer(ktype, row, r.take(cells * row).reshape(cells, row)))
    for _ in range(n_layer if has_v else 0):  # latent attention (MLA) caches have no V
        if not v_trans:
            vtype, row = r.unpack("<iQ")
            if not 0 <= vtype < 256 or row == 0:
                raise StateLayoutError(f"implausible V layer (type {vtype}, row {row} bytes)")
            sec.v.append(_Layer(vtype, row, r.take(cells * row).reshape(cells, row)))
        else:
            vtype, el, n_embd = r.unpack("<iII")
            data = r.take(n_embd * cells * el).reshape(n_embd, cells, el)
            sec.v.append(_Layer(vtype, el, data, n_embd))
    return sec


def _parse_recurrent(r: _Reader) -> RecurrentSection:
    """A recurrent section; it runs to the end of the buffer (a model's memory writes it last)."""
    (cells,) = r.unpack("<I")
    if cells > 1:
        raise StateLayoutError(f"a recurrent section of {cells} cells: one sequence holds one")
    meta = r.take(cells * _RMETA.itemsize).view(_RMETA)
    if np.any(meta["n_seq_id"] != 0):
        raise StateLayoutError("a recurrent cell written for several sequences")
    s_trans, n_layer = r.unpack("<II")
    if s_trans != 0 or not 0 < n_layer < 4096:
        raise StateLayoutError(f"implausible recurrent section (s_trans={s_trans}, n_layer={n_layer})")
    rows: list[_Layer] = []
    while r.off < r.arr.size:
        t, row = r.unpack("<iQ")
        if not 0 <= t < 256 or len(rows) >= 2 * n_layer:  # S rows of 0 bytes: LFM2's convolutions keep R only
            raise StateLayoutError(f"implausible recurrent layer (type {t}, row {row} bytes): a PLE "
                                   "history row or another layout")
        rows.append(_Layer(t, row, r.take(cells * row).reshape(cells, row)))
    k = len(rows) // 2
    if not rows or len(rows) % 2 or len({l.unit for l in rows[:k]}) != 1 or len({l.unit for l in rows[k:]}) != 1:
        raise StateLayoutError("the recurrent layers are not R rows then S rows of one size each")
    return RecurrentSection(meta=meta, n_layer=n_layer, r=rows[:k], s=rows[k:])


#: The readings of a KV section tried, most common first: plain with V, latent (no V), with ext records.
_KV_READINGS = ((False, True), (False, False), (True, True), (True, False))


def _parse_from(buf: np.ndarray, off: int, depth: int) -> list["Section | RecurrentSection"]:
    """The sections of ``buf[off:]``, each read in the first way under which the rest parses too."""
    if depth >= 8:
        raise StateLayoutError("more than 8 cache sections")
    first: Optional[StateLayoutError] = None
    for ext, has_v in _KV_READINGS:
        r = _Reader(buf)
        r.off = off
        try:
            sec = _parse_kv(r, ext, has_v)
            return [sec] + (_parse_from(buf, r.off, depth + 1) if r.off < buf.size else [])
        except StateLayoutError as exc:
            first = first or exc
    r = _Reader(buf)
    r.off = off
    try:
        return [_parse_recurrent(r)]
    except StateLayoutError:
        pass
    assert first is not None
    raise first


def parse_state(buf: memoryview | bytes) -> list["Section | RecurrentSection"]:
    """Every section of a per-sequence state, as zero-copy views into ``buf``: a `Section` per KV
    cache, a `RecurrentSection` for a recurrent memory (the module doc says which models write which).

    Raises `StateLayoutError` unless the whole buffer parses exactly (no trailing bytes).
    """
    r = _Reader(buf)
    magic, seq_id = r.unpack("<Ii")
    if magic != _IO_MAGIC or seq_id != 0:
        raise StateLayoutError(f"not a sequence-0 state (magic {magic:#x}, seq_id {seq_id})")
    if r.off >= r.arr.size:
        raise StateLayoutError("empty state")
    return _parse_from(r.arr, r.off, 0)


def layout(buf: memoryview | bytes) -> list[str]:
    """What each section of a state is, for logs, docs and tests: ``"kv"`` (``"kv+ext"`` with cell ext
    records, ``"kv-latent"`` without V) or ``"recurrent"``: Gemma 3 writes ``["kv", "kv"]``, Qwen 3.5
    ``["kv+ext", "recurrent"]``, DeepSeek 2 ``["kv-latent"]``, Mamba-2 ``["recurrent"]``."""
    out = []
    for s in parse_state(buf):
        if isinstance(s, RecurrentSection):
            out.append("recurrent")
        else:
            out.append("kv" + ("+ext" if s.ext else "") + ("-latent" if s.n_cells and s.k and not s.v else ""))
    return out


def _section_parts(sec: "Section | RecurrentSection") -> list[bytes | np.ndarray]:
    if isinstance(sec, RecurrentSection):
        rparts: list[bytes | np.ndarray] = [struct.pack("<I", sec.n_cells), sec.meta,
                                            struct.pack("<II", 0, sec.n_layer)]
        for l in sec.r + sec.s:
            rparts += [struct.pack("<iQ", l.type, l.unit), l.data]
        return rparts
    parts: list[bytes | np.ndarray] = [struct.pack("<II", 1, sec.n_cells)]
    if sec.n_cells == 0:
        return parts
    parts.append(sec.meta)
    parts.append(struct.pack("<II", int(sec.v_trans), len(sec.k)))
    for l in sec.k:
        parts += [struct.pack("<iQ", l.type, l.unit), l.data]
    for l in sec.v:
        parts += [struct.pack("<iII", l.type, l.unit, l.n_embd) if sec.v_trans
                  else struct.pack("<iQ", l.type, l.unit), l.data]
    return parts


def _concat(a: Section, b: Section) -> Section:
    if a.n_cells == 0:
        return b
    if b.n_cells == 0:
        return a
    if a.v_trans != b.v_trans or len(a.k) != len(b.k) or len(a.v) != len(b.v):
        raise StateLayoutError("sections of different shape cannot be joined")
    for la, lb in zip(a.k + a.v, b.k + b.v):
        if la.type != lb.type or la.unit != lb.unit or la.n_embd != lb.n_embd:
            raise StateLayoutError("layer types or row sizes differ between parent and delta")
    ax = 1 if a.v_trans else 0
    return Section(meta=np.concatenate([a.meta, b.meta]), v_trans=a.v_trans,
                   k=[_Layer(x.type, x.unit, np.concatenate([x.data, y.data])) for x, y in zip(a.k, b.k)],
                   v=[_Layer(x.type, x.unit, np.concatenate([x.data, y.data], axis=ax), x.n_embd)
                      for x, y in zip(a.v, b.v)])


@dataclass(frozen=True)
class _Zeros:
    """A run of ``n`` zero bytes in a part list (placeholder cells' K/V rows), written, never built."""

    n: int


@dataclass(frozen=True)
class _PaddedVT:
    """A transposed V layer with ``first`` zero cells before its cells, in every one of its rows."""

    first: int
    data: np.ndarray  # [n_embd, cells, el_size]

    @property
    def nbytes(self) -> int:
        e, c, el = self.data.shape
        return e * (self.first + c) * el


def _size(parts: list) -> int:
    return sum(p.n if isinstance(p, _Zeros) else p.nbytes if isinstance(p, (np.ndarray, _PaddedVT)) else len(p)
               for p in parts)


def _write(parts: list, out: Optional[memoryview]) -> bytes | memoryview:
    n = _size(parts)
    dst = np.empty(n, dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    if dst.size != n:
        raise StateLayoutError(f"output buffer holds {dst.size} bytes, the state needs {n}")
    off = 0
    for p in parts:
        if isinstance(p, _Zeros):
            dst[off:off + p.n] = 0
            off += p.n
            continue
        if isinstance(p, _PaddedVT):
            e, c, el = p.data.shape
            d3 = dst[off:off + p.nbytes].reshape(e, p.first + c, el)
            d3[:, :p.first] = 0
            d3[:, p.first:] = p.data
            off += p.nbytes
            continue
        b = np.frombuffer(p, dtype=np.uint8) if isinstance(p, bytes) else np.ascontiguousarray(p).reshape(-1).view(np.uint8)
        dst[off:off + b.size] = b
        off += b.size
    return dst.tobytes() if out is None else out


def encode_state(sections: "Sequence[Section | RecurrentSection]") -> bytes:
    """The llama.cpp per-sequence state bytes of ``sections`` (inverse of `parse_state()`)."""
    return bytes(_write([struct.pack("<Ii", _IO_MAGIC, 0)] + [p for s in sections for p in _section_parts(s)], None))


def split(parent: memoryview | bytes, full: memoryview | bytes, parent_end: int) -> bytes:
    """The delta that turns ``parent``'s state into ``full`` (parent cells + cells at positions
    ``>= parent_end``). Raises `StateLayoutError` if ``full`` is not, section by section, a
    suffix of the parent's cells followed by new cells; the caller must still compare
    ``merge(parent, delta)`` with ``full`` byte for byte."""
    ps, fs = parse_state(parent), parse_state(full)
    if len(ps) != len(fs):
        raise StateLayoutError(f"parent has {len(ps)} cache sections, the full state {len(fs)}")
    keeps: list[int] = []
    news: list[Section | RecurrentSection] = []
    for p, f in zip(ps, fs):
        if isinstance(p, RecurrentSection) or isinstance(f, RecurrentSection):
            _same_recurrent(p, f)
            if f.n_cells and int(f.positions[0]) < parent_end - 1:
                raise StateLayoutError("the full state's recurrent cell is older than the parent's end")
            keeps.append(0)  # replaced whole: the state after the child's last token
            news.append(f)
            continue
        fpos = f.positions
        n_old = int(np.searchsorted(fpos, parent_end)) if f.n_cells else 0
        if n_old > p.n_cells or (n_old and not np.array_equal(fpos[:n_old], p.positions[p.n_cells - n_old:])):
            raise StateLayoutError("the full state's old cells are not a suffix of the parent's cells")
        keeps.append(n_old)
        news.append(f.take(slice(n_old, None)))
    head = DELTA_MAGIC + struct.pack(f"<I{len(keeps)}I", len(keeps), *keeps)
    return head + encode_state(news)


def _same_recurrent(a: "Section | RecurrentSection", b: "Section | RecurrentSection") -> None:
    """Raise unless ``a`` and ``b`` are recurrent sections of the same layers (types and row sizes)."""
    if not (isinstance(a, RecurrentSection) and isinstance(b, RecurrentSection)):
        raise StateLayoutError("a recurrent section stands against a KV section")
    if a.n_layer != b.n_layer or [(l.type, l.unit) for l in a.r + a.s] != [(l.type, l.unit) for l in b.r + b.s]:
        raise StateLayoutError("recurrent sections of different layers")


def _parse_delta(delta: memoryview | bytes) -> tuple[list[int], list["Section | RecurrentSection"]]:
    d = bytes(delta[:12])
    if d[:8] != DELTA_MAGIC:
        raise StateLayoutError("not a graftmem state delta (bad magic)")
    (n,) = struct.unpack_from("<I", d, 8)
    if not 0 < n <= 8:
        raise StateLayoutError(f"delta claims {n} sections")
    keeps = list(struct.unpack_from(f"<{n}I", bytes(delta[12:12 + 4 * n])))
    news = parse_state(memoryview(delta)[12 + 4 * n:])
    if len(news) != n:
        raise StateLayoutError(f"delta header names {n} sections, its state has {len(news)}")
    return keeps, news


def _merged_parts(parent: memoryview | bytes, delta: memoryview | bytes) -> list[bytes | np.ndarray]:
    keeps, news = _parse_delta(delta)
    ps = parse_state(parent)
    if len(ps) != len(news):
        raise StateLayoutError(f"parent has {len(ps)} sections, the delta {len(news)}")
    parts: list[bytes | np.ndarray] = [struct.pack("<Ii", _IO_MAGIC, 0)]
    for p, k, nsec in zip(ps, keeps, news):
        if isinstance(p, RecurrentSection) or isinstance(nsec, RecurrentSection):
            _same_recurrent(p, nsec)
            if k:
                raise StateLayoutError("a delta cannot keep cells of a recurrent section")
            parts += _section_parts(nsec)
            continue
        if k > p.n_cells:
            raise StateLayoutError(f"delta keeps {k} cells of a parent section holding {p.n_cells}")
        parts += _section_parts(_concat(p.take(slice(p.n_cells - k, None)), nsec))
    return parts


def delta_sizes(parent: memoryview | bytes, delta: memoryview | bytes) -> int:
    """Size in bytes of the full state that ``merge(parent, delta)`` produces."""
    return _size(_merged_parts(parent, delta))


def merge(parent: memoryview | bytes, delta: memoryview | bytes,
          out: Optional[memoryview] = None) -> bytes | memoryview:
    """Rebuild the full state from the parent's full state and a child's delta.

    With ``out`` (exactly `delta_sizes()` bytes, e.g. the engine's state buffer) the bytes are
    written there and ``out`` is returned; otherwise new ``bytes`` are returned.
    """
    return _write(_merged_parts(parent, delta), out)


def place_cells(state: memoryview | bytes, n_positions: int) -> Optional[bytes]:
    """The state with every section's cells at the indices a fresh prefill gives them, or None if
    they already are.

    A sliding-window section holds only the cells its last position still sees (positions
    ``first..n-1``), so a plain restore puts position ``first`` at cell 0, not at cell ``first``.
    llama.cpp's CPU flash-attention then rounds differently from a fresh prefill whenever cell
    indices matter: single-token decodes over >= 512 cells (the split-KV path cuts the cells into
    per-thread chunks) and micro-batches of >= 64 tokens (the tiled path works on 64-cell tiles).
    Measured on Gemma 3 270M with a 660-token block: a plain graft differs from a fresh prefill for
    1-token and >= 64-token queries and in greedy generation; with the placeholders it does not.

    The placeholders (positions ``0..first-1``, K and V all zero) are masked by the window for every
    later token, so they never contribute to attention; they only keep the real cells in place.
    """
    parts = _placed_parts(parse_state(state), n_positions)
    return None if parts is None else bytes(_write(parts, None))


def needs_placing(state: memoryview | bytes) -> bool:
    """Whether `place_cells()` would change ``state`` (a section does not start at position 0)."""
    return any(isinstance(s, Section) and s.n_cells and int(s.positions[0]) != 0 for s in parse_state(state))


def place_cells_into(state: memoryview | bytes, n_positions: int, out: Callable[[int], memoryview]) -> memoryview:
    """`place_cells()` written straight into ``out(n)`` (the engine's state buffer): no
    intermediate section arrays or bytes, the placeholders' zero rows written in place. ``state``
    must not live in the memory ``out`` returns. Raises `StateLayoutError` if nothing needs
    placing (check with `needs_placing()`)."""
    parts = _placed_parts(parse_state(state), n_positions)
    if parts is None:
        raise StateLayoutError("no section needs placing")
    view = out(_size(parts))
    _write(parts, view)
    return view


def _placed_parts(secs: "list[Section | RecurrentSection]", n_positions: int) -> Optional[list]:
    if all(isinstance(s, RecurrentSection) or s.n_cells == 0 or int(s.positions[0]) == 0 for s in secs):
        return None
    parts: list = [struct.pack("<Ii", _IO_MAGIC, 0)]
    for s in secs:
        first = int(s.positions[0]) if s.n_cells else 0
        if isinstance(s, RecurrentSection) or first == 0:  # a recurrent cell is the last position's
            parts += _section_parts(s)
            continue
        if s.ext:
            raise StateLayoutError("a trimmed window section with cell ext records: no placeholder ext is known")
        if int(s.positions[-1]) != n_positions - 1 or s.n_cells != n_positions - first:
            raise StateLayoutError("a trimmed section is not the contiguous tail of the positions")
        meta = np.zeros(first, dtype=_META)
        meta["pos"], meta["n_seq_id"] = np.arange(first, dtype=np.int32), 1
        parts += [struct.pack("<II", 1, n_positions), meta, s.meta, struct.pack("<II", int(s.v_trans), len(s.k))]
        for l in s.k:
            parts += [struct.pack("<iQ", l.type, l.unit), _Zeros(first * l.unit), l.data]
        for l in s.v:
            if s.v_trans:
                parts += [struct.pack("<iII", l.type, l.unit, l.n_embd), _PaddedVT(first, l.data)]
            else:
                parts += [struct.pack("<iQ", l.type, l.unit), _Zeros(first * l.unit), l.data]
    return parts


def join(first: memoryview | bytes, second: memoryview | bytes) -> bytes:
    """Stitch two independently captured states into one: each section's cells of ``first``
    followed by those of ``second`` (whose positions must all come later).

    This is the *stitching* the paper measures as wrong (KL 13.85): ``second``'s cells were computed
    without attending to ``first``, so the result is not what a prefill of both texts computes.
    It exists for ``bench/position.py``; nothing exact is built on it.
    """
    a, b = parse_state(first), parse_state(second)
    if len(a) != len(b):
        raise StateLayoutError(f"{len(a)} sections cannot be joined with {len(b)}")
    if any(isinstance(x, RecurrentSection) for x in a + b):
        raise StateLayoutError("a recurrent state cannot be joined: it is the state after one position, "
                               "not cells to concatenate")
    for x, y in zip(a, b):
        if x.n_cells and y.n_cells and int(y.positions[0]) <= int(x.positions[-1]):
            raise StateLayoutError("the second state's positions must follow the first's")
    return encode_state([_concat(x, y) for x, y in zip(a, b)])  # type: ignore[arg-type]


def cuttable(sections: "list[Section | RecurrentSection]") -> int:
    """How many positions every section of a parsed state holds from position 0, contiguously, in cell
    order (the ``n`` of a state that `cut()` can shorten); raises `StateLayoutError` otherwise, and for
    a state with a recurrent section (which holds only the state after its last position, ``n - 1``:
    nothing shorter can be cut out of it, see `cut`)."""
    if any(isinstance(s, RecurrentSection) for s in sections):
        raise StateLayoutError("a recurrent (or hybrid) state holds only the state after its last position: "
                               "the state of a shorter prefix cannot be cut out of it; capture it at that "
                               "prefix's end instead")
    n = -1
    for s in sections:
        pos = s.positions
        if n < 0:
            n = s.n_cells
        if s.n_cells != n or (n and (int(pos[0]) != 0 or int(pos[-1]) != n - 1)):
            raise StateLayoutError("a section does not hold every position from 0 (a sliding-window section "
                                   "past its window): the state of a shorter prefix cannot be cut out of it")
    return max(n, 0)


def cut(state: memoryview | bytes | bytearray, n_tokens: int) -> bytearray:
    """The per-sequence state of the first ``n_tokens`` positions, cut out of the state of a longer
    sequence that was computed by the same prefill calls up to ``n_tokens`` (the cells a request left in
    its engine, the answer's included).

    Why this is the state a fresh prefill of those calls captures: llama.cpp writes one cell per
    position in cell order, each cell's K row (and V row, or V column when transposed) computed once,
    when its token was prefilled, and never touched by later tokens; a cache filled from empty holds
    position ``p`` at cell ``p``. So the first ``n_tokens`` cells of the longer state are byte for byte
    the cells a capture after the ``n_tokens``-th token writes (tests/test_state_cut.py compares them
    with fresh captures on SmolLM2 and Gemma 3).

    Where it is impossible: a sliding-window section writes only the cells its LAST position still
    sees (``llama_kv_cache::state_write`` skips SWA-masked cells), so the capture of a sequence longer
    than the window lacks the cells ``n_tokens - window .. `` that a shorter prefix's state holds. Such
    a state raises `StateLayoutError` (`cuttable()`): capture at the prefix's end instead. So does any
    state with a recurrent section (Mamba, the hybrids): its recurrent state was overwritten by every
    token after ``n_tokens``."""
    secs = parse_state(state)
    n = cuttable(secs)
    if not 0 < n_tokens <= n:
        raise StateLayoutError(f"cannot cut {n_tokens} positions out of a state of {n}")
    parts = [struct.pack("<Ii", _IO_MAGIC, 0)] + [p for s in secs if isinstance(s, Section)
                                                   for p in _section_parts(s.take(slice(0, n_tokens)))]
    out = bytearray(_size(parts))  # written once (encode_state's bytes would copy it again)
    _write(parts, memoryview(out))
    return out
