"""The KV pool's two tiers on this machine (KVPOOL.md §4.3): a DRAM segment per pool server and
one file per block in an SSD directory.

DRAM tier: the POSIX shared-memory segment `/xpod.<pod>.pool<s>`, owner-only (0600), created
and unlinked by its pool server (`runtime.engine.pool_server`; the engine unlinks it after a
SIGKILL). One header page, then the slots laid out exactly like a die's KV pool:

```
 [0, HEADER_BYTES)  magic b"XPODPOOL", version, header bytes, fingerprint (16 B), n_layers,
                    n_slots, block_size, row_floats, creator pid      (magic written last)
 [HEADER_BYTES, .)  float32 [n_layers, n_slots, block_size, row_floats]
```
so `comm.kvlink.KVGeometry(*seg.kv_args())` describes it and `segments()` coalesces runs of
slots and die blocks unchanged.

SSD tier: `<dir>/<fingerprint hex>/<ns dir>/<hash:016x>.blk`, written to `<name>.tmp.<pid>` and
renamed (a reader never sees half a file under a final name), re-indexed by `scan` when a
server starts. A file:

```
 "<8s16sBH"  magic b"XPODBLK2", fingerprint, flags (1: has parent, 2: has ns), ns bytes
 ns          utf-8
 "<QQIIQ"    hash, parent (0 without), n tokens, crc of the payload, payload bytes
 "<{n}q"     tokens
 "<I"        crc of every header byte before it
 payload     float32 [n_layers][block_size][row_floats] (block-major: a slot's layer spans in
             layer order, so its crc is `block_crc` of the slot)
```

`block_crc` is the one per-block checksum of the pool (store, load, files): `pool_crc`
(CRC-32C) over the (layer, block) spans of a block, layer-major. Nothing here imports `comm/`:
a geometry is any object with `pool_off, n_layers, n_blocks, block_size, row_floats`
(`comm.kvlink.KVGeometry`).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import crc32c
import numpy as np
import posix_ipc

from memory.errors import ConfigError, ProtocolError, ShmError
from memory.region import unlink_segment

MiB = 1 << 20
POOL_MAGIC = b"XPODPOOL"
POOL_VERSION = 1
HEADER_BYTES = max(4096, mmap.PAGESIZE)
FINGERPRINT_BYTES = 16
# magic, version, header bytes, fingerprint, n_layers, n_slots, block_size, row_floats, pid
_POOL_HEAD = struct.Struct("<8sII16sqqqqq")

FILE_MAGIC = b"XPODBLK2"  # 2: CRC-32C (1 was zlib's crc32)
_FILE_HEAD = struct.Struct("<8s16sBH")  # magic, fingerprint, flags, ns bytes
_FILE_KEY = struct.Struct("<QQIIQ")  # hash, parent, n tokens, payload crc, payload bytes
_FILE_HCRC = struct.Struct("<I")
HAS_PARENT, HAS_NS = 1, 2
MAX_NS_BYTES = 1024
MAX_TOKENS = 1 << 16
TMP_MARK = ".tmp."
PROBE_PREFIX = ".xpod-probe."
_NS_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FP_DIR = re.compile(r"[0-9a-f]{32}")


def pool_crc(data, value: int = 0) -> int:
    """The pool's checksum: CRC-32C (Castagnoli) of a buffer, continuing `value`. The `crc32c`
    package computes it with the CPU's crc32 instruction (SSE 4.2: ~20 GB/s here, against ~3.6
    GB/s for zlib's crc32), which puts a load's end-to-end check below its copy; it falls back
    to software where the instruction is missing (the same values)."""
    return crc32c.crc32c(data, value)


class BlockFileError(ProtocolError):
    """A block file that is not a complete, intact block of this pool (names the file)."""


class KVShape(Protocol):
    """What `block_crc` needs of a geometry (`comm.kvlink.KVGeometry` has it)."""

    pool_off: int
    n_layers: int
    n_blocks: int
    block_size: int
    row_floats: int


def block_crc(arr: np.ndarray, geo: KVShape, block: int, rows: int | None = None) -> int:
    """`pool_crc` of block `block` of the pool `geo` in the uint8 mapping `arr`: its (layer, block)
    spans in layer order (the first `rows` rows of each, default all). The same function on
    both sides of a copy: the pool server's slots, a die's blocks, a file's payload."""
    if not 0 <= block < geo.n_blocks:
        raise ProtocolError(f"block_crc: block {block} is outside the pool of {geo.n_blocks}")
    rows = geo.block_size if rows is None else rows
    if not 0 < rows <= geo.block_size:
        raise ProtocolError(f"block_crc: {rows} rows of a block of {geo.block_size}")
    stride = geo.block_size * geo.row_floats * 4
    n = rows * geo.row_floats * 4
    crc = 0
    for layer in range(geo.n_layers):
        off = geo.pool_off + (layer * geo.n_blocks + block) * stride
        crc = pool_crc(arr[off : off + n], crc)
    return crc


def make_fingerprint(*parts: object) -> bytes:
    """16 bytes of blake2b over the reprs of `parts` (model fields, block size, KV format...)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=FINGERPRINT_BYTES).digest()


def _check_fp(fingerprint: bytes) -> bytes:
    if not isinstance(fingerprint, bytes | bytearray) or len(fingerprint) != FINGERPRINT_BYTES:
        raise ConfigError(f"pool fingerprint must be {FINGERPRINT_BYTES} bytes, got "
                          f"{fingerprint!r:.60}")  # fmt: skip
    return bytes(fingerprint)


def _check_dims(**dims: int) -> None:
    for name, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"pool {name} must be an int >= 1, got {v!r}")


# -- DRAM tier ---------------------------------------------------------------------------------


def pool_segment_name(pod: str, server: int) -> str:
    return f"/xpod.{pod}.pool{server}"


def slot_bytes(n_layers: int, block_size: int, row_floats: int) -> int:
    """Bytes of one slot over all layers (one die block)."""
    return n_layers * block_size * row_floats * 4


def pool_bytes(n_slots: int, n_layers: int, block_size: int, row_floats: int) -> int:
    """Bytes of a DRAM segment of `n_slots` slots, header included."""
    return HEADER_BYTES + n_slots * slot_bytes(n_layers, block_size, row_floats)


def shm_free_bytes(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo in bytes (a large number where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def slots_for(mib: float, n_layers: int, block_size: int, row_floats: int, *,
              shm_free: int | None = None, mem_available: int | None = None) -> int:  # fmt: skip
    """How many slots a DRAM tier of `mib` MiB (its header included) holds. ConfigError when
    that is none, or when the segment would not fit in /dev/shm's free space or MemAvailable
    (`shm_free` / `mem_available` in bytes: the machine's, unless given)."""
    _check_dims(n_layers=n_layers, block_size=block_size, row_floats=row_floats)
    if isinstance(mib, bool) or not isinstance(mib, int | float) or not mib > 0:
        raise ConfigError(f"--pool-dram-mib must be a number > 0, got {mib!r}")
    slot = slot_bytes(n_layers, block_size, row_floats)
    n = (int(mib * MiB) - HEADER_BYTES) // slot
    if n < 1:
        raise ConfigError(f"--pool-dram-mib {mib:g} holds no block: a block of {n_layers} layers x"
                          f" {block_size} tokens x {row_floats} floats is {slot} B, plus a"
                          f" {HEADER_BYTES} B header")  # fmt: skip
    need = pool_bytes(n, n_layers, block_size, row_floats)
    shm_free = shm_free_bytes() if shm_free is None else shm_free
    mem_available = mem_available_bytes() if mem_available is None else mem_available
    for what, have in (("/dev/shm has", shm_free), ("MemAvailable is", mem_available)):
        if need > have:
            raise ConfigError(f"--pool-dram-mib {mib:g}: the DRAM tier needs"
                              f" {need / MiB:.1f} MiB and {what} {have / MiB:.1f} MiB free:"
                              f" give a smaller size")  # fmt: skip
    return n


class PoolSegment:
    """A mapped DRAM tier. Build with `create_pool` (its server) or `attach_pool` (anyone)."""

    def __init__(self, name: str, mm: mmap.mmap, fingerprint: bytes, n_layers: int,
                 n_slots: int, block_size: int, row_floats: int, creator_pid: int):  # fmt: skip
        self.name, self.fingerprint, self.creator_pid = name, fingerprint, creator_pid
        self.n_layers, self.n_slots = n_layers, n_slots
        self.block_size, self.row_floats = block_size, row_floats
        self._mmap: mmap.mmap | None = mm
        self.array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)

    def kv_args(self) -> tuple[int, int, int, int, int]:
        """`KVGeometry(*seg.kv_args())`: (header bytes, n_layers, n_slots, block_size, row)."""
        return HEADER_BYTES, self.n_layers, self.n_slots, self.block_size, self.row_floats

    def slots(self) -> np.ndarray:
        """float32 `[n_layers, n_slots, block_size, row_floats]` view of the slots."""
        shape = (self.n_layers, self.n_slots, self.block_size, self.row_floats)
        n = int(np.prod(shape)) * 4
        return self.array[HEADER_BYTES : HEADER_BYTES + n].view(np.float32).reshape(shape)

    def close(self) -> None:
        self.array = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view still held: unmapped with it
                self._mmap.close()
            self._mmap = None

    def unlink(self) -> bool:
        return unlink_segment(self.name)


def create_pool(pod: str, server: int, fingerprint: bytes, n_layers: int, n_slots: int,
                block_size: int, row_floats: int) -> PoolSegment:  # fmt: skip
    """Create `/xpod.<pod>.pool<server>` (0600, fails if it exists), reserve its memory
    (posix_fallocate: a full /dev/shm fails here, not as a SIGBUS later) and write the header."""
    fingerprint = _check_fp(fingerprint)
    _check_dims(n_layers=n_layers, n_slots=n_slots, block_size=block_size, row_floats=row_floats)
    name = pool_segment_name(pod, server)
    size = pool_bytes(n_slots, n_layers, block_size, row_floats)
    try:
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
    except (posix_ipc.Error, OSError, ValueError) as e:
        raise ShmError(f"shm_open({name}, O_CREX, {size} B): {e}") from e
    try:
        os.posix_fallocate(shm.fd, 0, size)
        mm = mmap.mmap(shm.fd, size)
    except OSError as e:
        unlink_segment(name)
        raise ShmError(f"pool segment {name} of {size / MiB:.1f} MiB: {e}") from e
    finally:
        shm.close_fd()
    pid = os.getpid()
    head = _POOL_HEAD.pack(b"\0" * 8, POOL_VERSION, HEADER_BYTES, fingerprint, n_layers, n_slots,
                           block_size, row_floats, pid)  # fmt: skip
    mm[: _POOL_HEAD.size] = head
    mm[:8] = POOL_MAGIC  # last: a reader that sees the magic sees a complete header
    return PoolSegment(name, mm, fingerprint, n_layers, n_slots, block_size, row_floats, pid)


def attach_pool(pod: str, server: int, fingerprint: bytes | None = None) -> PoolSegment:
    """Map an existing DRAM tier and check its header (and fingerprint, if given)."""
    name = pool_segment_name(pod, server)
    try:
        shm = posix_ipc.SharedMemory(name)
    except (posix_ipc.Error, OSError) as e:
        raise ShmError(f"shm_open({name}): {e}") from e
    try:
        if shm.size < HEADER_BYTES:
            raise ProtocolError(f"attach({name}): {shm.size} bytes, no pool header")
        mm = mmap.mmap(shm.fd, shm.size)
    except OSError as e:
        raise ShmError(f"mmap({name}): {e}") from e
    finally:
        shm.close_fd()
    magic, version, hb, fp, n_layers, n_slots, bs, row, pid = _POOL_HEAD.unpack_from(mm, 0)
    problem = None
    if magic != POOL_MAGIC:
        problem = f"bad magic {magic!r}"
    elif version != POOL_VERSION or hb != HEADER_BYTES:
        problem = f"pool layout version {version} ({hb} B header), this code speaks {POOL_VERSION}"
    elif fingerprint is not None and fp != _check_fp(fingerprint):
        problem = f"fingerprint {fp.hex()}, expected {bytes(fingerprint).hex()}"
    elif len(mm) < pool_bytes(n_slots, n_layers, bs, row):
        problem = f"{len(mm)} bytes, the header says {pool_bytes(n_slots, n_layers, bs, row)}"
    if problem is not None:
        mm.close()
        raise ProtocolError(f"attach({name}): {problem}")
    return PoolSegment(name, mm, fp, n_layers, n_slots, bs, row, pid)


def unlink_pool(pod: str, server: int) -> bool:
    """Unlink server `server`'s DRAM segment; False if it was already gone."""
    return unlink_segment(pool_segment_name(pod, server))


# -- SSD tier ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockEntry:
    """One block file: its key, identity and where it is."""

    h: int
    ns: str | None
    parent: int | None
    tokens: tuple[int, ...]
    crc: int
    path: str

    def to_wire(self) -> list:
        return [self.h, self.ns, self.parent, list(self.tokens), self.crc, self.path]


@dataclass
class ScanResult:
    entries: list[BlockEntry] = field(default_factory=list)
    skipped: int = 0  # corrupt, truncated, foreign or stray files (left in place)
    removed_tmp: int = 0  # half-written temp files deleted
    problems: list[str] = field(default_factory=list)  # why each skipped file was skipped


def ns_dir(ns: str | None) -> str:
    """The directory of namespace `ns`: "_" for none, the name itself when it is a plain file
    name, else "~" + a hash of it (a name with "/" or ".." never becomes a path)."""
    if ns is None:
        return "_"
    if _NS_SAFE.fullmatch(ns):
        return ns
    return "~" + hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()


def block_path(root: str, fingerprint: bytes, ns: str | None, h: int) -> str:
    return os.path.join(root, _check_fp(fingerprint).hex(), ns_dir(ns), f"{h:016x}.blk")


def encode_header(fingerprint: bytes, h: int, ns: str | None, parent: int | None,
                  tokens: Sequence[int], crc: int, payload_bytes: int) -> bytes:  # fmt: skip
    nsb = b"" if ns is None else ns.encode()
    if len(nsb) > MAX_NS_BYTES or len(tokens) > MAX_TOKENS:
        raise ProtocolError(f"block file: namespace of {len(nsb)} B or {len(tokens)} tokens")
    flags = (HAS_PARENT if parent is not None else 0) | (HAS_NS if ns is not None else 0)
    try:
        head = b"".join((
            _FILE_HEAD.pack(FILE_MAGIC, _check_fp(fingerprint), flags, len(nsb)), nsb,
            _FILE_KEY.pack(h, parent or 0, len(tokens), crc, payload_bytes),
            struct.pack(f"<{len(tokens)}q", *tokens),
        ))  # fmt: skip
    except struct.error as e:  # a hash or token out of range
        raise ProtocolError(f"block file of {h!r}: {e}") from None
    return head + _FILE_HCRC.pack(pool_crc(head))


def decode_header(buf: bytes, path: str = "?") -> tuple[bytes, BlockEntry, int, int]:
    """(fingerprint, entry, header bytes, payload bytes) of a file's first bytes."""

    def need(n: int) -> None:
        if len(buf) < n:
            raise BlockFileError(f"block file {path}: truncated header ({len(buf)} B)")

    need(_FILE_HEAD.size)
    magic, fp, flags, ns_len = _FILE_HEAD.unpack_from(buf, 0)
    if magic != FILE_MAGIC:
        raise BlockFileError(f"block file {path}: bad magic {magic!r}")
    if ns_len > MAX_NS_BYTES:
        raise BlockFileError(f"block file {path}: namespace of {ns_len} B")
    off = _FILE_HEAD.size + ns_len
    need(off + _FILE_KEY.size)
    h, parent, n_tok, crc, payload = _FILE_KEY.unpack_from(buf, off)
    if n_tok > MAX_TOKENS:
        raise BlockFileError(f"block file {path}: {n_tok} tokens")
    off += _FILE_KEY.size
    need(off + 8 * n_tok + _FILE_HCRC.size)
    tokens = struct.unpack_from(f"<{n_tok}q", buf, off)
    off += 8 * n_tok
    if _FILE_HCRC.unpack_from(buf, off)[0] != pool_crc(buf[:off]):
        raise BlockFileError(f"block file {path}: header crc mismatch")
    try:
        ns = buf[_FILE_HEAD.size : _FILE_HEAD.size + ns_len].decode() if flags & HAS_NS else None
    except UnicodeDecodeError:
        raise BlockFileError(f"block file {path}: namespace is not utf-8") from None
    entry = BlockEntry(h, ns, parent if flags & HAS_PARENT else None, tokens, crc, path)
    return fp, entry, off + _FILE_HCRC.size, payload


def write_block(root: str, fingerprint: bytes, h: int, ns: str | None, parent: int | None,
                tokens: Sequence[int], payload: Sequence, *,
                fsync: bool = False) -> BlockEntry:  # fmt: skip
    """Write one block file (`payload`: buffers written in order, a slot's layer spans) to
    `<root>/<fingerprint hex>/<ns dir>/<h:016x>.blk` through `<name>.tmp.<pid>` and
    `os.replace`; `fsync`: the file and its directory reach the disk first. Returns its entry."""
    path = block_path(root, fingerprint, ns, h)
    parts = [memoryview(p).cast("B") for p in payload]
    crc = 0
    for p in parts:
        crc = pool_crc(p, crc)
    head = encode_header(fingerprint, h, ns, parent, [int(t) for t in tokens], crc,
                         sum(len(p) for p in parts))  # fmt: skip
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as f:
            f.write(head)
            for p in parts:
                f.write(p)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return BlockEntry(h, ns, parent, tuple(int(t) for t in tokens), crc, path)


def read_block(path: str, fingerprint: bytes | None = None,
               payload_bytes: int | None = None) -> tuple[BlockEntry, np.ndarray]:  # fmt: skip
    """(entry, uint8 payload) of a block file; BlockFileError if it is not whole, its crc does
    not match, or it is of another fingerprint or payload size (when given)."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise BlockFileError(f"block file {path}: {e}") from None
    fp, entry, off, n = decode_header(buf, path)
    if fingerprint is not None and fp != _check_fp(fingerprint):
        raise BlockFileError(f"block file {path}: fingerprint {fp.hex()}, not this pool's")
    if payload_bytes is not None and n != payload_bytes:
        raise BlockFileError(f"block file {path}: payload of {n} B, a block is {payload_bytes}")
    if len(buf) != off + n:
        raise BlockFileError(f"block file {path}: {len(buf) - off} payload bytes, header says {n}")
    payload = np.frombuffer(buf, np.uint8, n, off)
    if pool_crc(payload) != entry.crc:
        raise BlockFileError(f"block file {path}: payload crc mismatch")
    return entry, payload


def scan(root: str, fingerprint: bytes, payload_bytes: int | None = None) -> ScanResult:
    """Re-index `<root>/<fingerprint hex>/`: every intact block file of this fingerprint (crc
    checked, named after its hash, in its namespace's directory). Deletes leftover temp files;
    skips and counts anything else (corrupt, truncated, foreign fingerprint, stray), leaving it."""
    out = ScanResult()
    top = os.path.join(root, _check_fp(fingerprint).hex())
    if not os.path.isdir(top):
        return out

    def skip(path: str, why: str) -> None:
        out.skipped += 1
        out.problems.append(f"{path}: {why}")

    for sub in sorted(os.listdir(top)):
        d = os.path.join(top, sub)
        if not os.path.isdir(d) or os.path.islink(d):
            skip(d, "not a namespace directory")
            continue
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if TMP_MARK in name:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    out.removed_tmp += 1
                continue
            if not name.endswith(".blk") or not os.path.isfile(path):
                skip(path, "not a block file")
                continue
            try:
                entry, _ = read_block(path, fingerprint, payload_bytes)
            except BlockFileError as e:
                skip(path, str(e))
                continue
            if name != f"{entry.h:016x}.blk" or sub != ns_dir(entry.ns):
                skip(path, f"holds block {entry.h:016x} of namespace {entry.ns!r}")
                continue
            out.entries.append(entry)
    return out


def check_pool_dir(path: str) -> str:
    """The absolute SSD tier directory `path`, created (0700) if missing. ConfigError naming it
    when it cannot be created or written, or holds at its top level anything but fingerprint
    directories (a pool never deletes files that are not its own)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--pool-ssd-dir {path}: not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = os.path.join(path, f"{PROBE_PREFIX}{os.getpid()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--pool-ssd-dir {path}: not a writable directory ({e})") from None
    stray = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith(PROBE_PREFIX):  # a probe whose writer died
            with contextlib.suppress(OSError):
                os.unlink(full)
        elif not (_FP_DIR.fullmatch(name) and os.path.isdir(full) and not os.path.islink(full)):
            stray.append(name)
    if stray:
        more = f" (and {len(stray) - 5} more)" if len(stray) > 5 else ""
        raise ConfigError(f"--pool-ssd-dir {path} holds files that are not xpod pool files:"
                          f" {', '.join(stray[:5])}{more}; give an empty directory or one"
                          f" only the pool uses")  # fmt: skip
    return path


__all__ = [
    "FILE_MAGIC", "HEADER_BYTES", "POOL_MAGIC", "BlockEntry", "BlockFileError", "PoolSegment",
    "ScanResult", "attach_pool", "block_crc", "block_path", "check_pool_dir", "create_pool",
    "make_fingerprint", "ns_dir", "pool_bytes", "pool_crc", "pool_segment_name", "read_block",
    "scan", "slot_bytes", "slots_for", "unlink_pool", "write_block",
]  # fmt: skip
