"""The cold record format (format version 1): a 4096-byte header area, then the payload padded
to 4096 bytes, so that every record can be read and written with O_DIRECT.

    header (little-endian): magic "KVBR" | format u16 | codec u8 | dtype u8 | ndim u8 | pad u8 |
                            shape 5 x u32 | key 16s | namespace 16s | payload_len u64 |
                            payload xxh3_64 u64 | header xxh3_64 u64 (of everything before it)

Nothing in a record is deserialized with pickle or `torch.load`: a tampered file can fail a
checksum, never execute code.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch
import xxhash

from kvagentd.kvcache.base import BlockKey, KVGeometry
from kvagentd.kvcache.codec import CODEC_BY_ID, Codec, CodecId

MAGIC = b"KVBR"
FORMAT_VERSION = 1
ALIGN = 4096
_HDR = struct.Struct("<4sHBBBB5I16s16sQQ")
_HDR_SUM = struct.Struct("<Q")
HEADER_BYTES = _HDR.size + _HDR_SUM.size  # padded to ALIGN on disk

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPE_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}

Buffer = bytearray | memoryview | mmap.mmap


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def signed64(x: int) -> int:
    """SQLite integers are signed 64-bit."""
    return x - (1 << 64) if x >= (1 << 63) else x


class RecordRow(NamedTuple):
    """Where one record lives, as the index says (`checksum` unsigned)."""

    key: BlockKey
    segment: int
    offset: int
    length: int
    payload_len: int
    checksum: int


def record_bytes(codec: Codec) -> int:
    """On-disk size of one record of `codec`."""
    return ALIGN + align(codec.payload_nbytes)


def pack_header(buf: Buffer, off: int, key: BlockKey, namespace: bytes, geometry: KVGeometry,
                codec: Codec, payload: memoryview) -> int:
    """Write a record header at `buf[off:]`; returns the payload checksum."""
    shape = list(geometry.block_shape) + [0] * (5 - len(geometry.block_shape))
    csum = xxhash.xxh3_64_intdigest(payload)
    _HDR.pack_into(buf, off, MAGIC, FORMAT_VERSION, codec.id, DTYPE_CODES[geometry.dtype],
                   len(geometry.block_shape), 0, *shape, key, namespace, codec.payload_nbytes, csum)
    mv = memoryview(buf)
    _HDR_SUM.pack_into(buf, off + _HDR.size, xxhash.xxh3_64_intdigest(mv[off:off + _HDR.size]))
    return csum


def header_row(buf: Buffer | bytes, key: BlockKey) -> RecordRow | None:
    """The row a record's own header describes, for a record kept without an index row (the
    remote tier: one record per value); None when `buf` is too short to hold a header. Every
    field is then checked by `check_record` as for an indexed record."""
    if len(buf) < ALIGN:
        return None
    h = _HDR.unpack_from(buf, 0)
    return RecordRow(key, -1, 0, len(buf), h[13], h[14])


def check_record(buf: Buffer | bytes, off: int, row: RecordRow, namespace: bytes,
                 geometry: KVGeometry, codec_for: Callable[[int], Codec],
                 payload: memoryview | None = None) -> int | str:
    """The codec id of the record at `buf[off:]` after every check, or why it failed.
    `payload`: where the payload was read to, when not right after the header in `buf`."""
    mv = memoryview(buf)
    h = _HDR.unpack_from(buf, off)
    if h[0] != MAGIC or h[1] != FORMAT_VERSION:
        return "bad magic or format"
    if _HDR_SUM.unpack_from(buf, off + _HDR.size)[0] != xxhash.xxh3_64_intdigest(mv[off:off + _HDR.size]):
        return "header checksum"
    cid, dcode, ndim = h[2], h[3], h[4]
    shape = tuple(h[6:6 + ndim])
    key, ns, plen, psum = h[11], h[12], h[13], h[14]
    if key != row.key or ns != namespace:
        return "key or namespace mismatch"
    if cid not in CODEC_BY_ID or DTYPE_BY_CODE.get(dcode) != geometry.dtype \
            or shape != geometry.block_shape:
        return "codec, dtype or shape mismatch"
    if plen != codec_for(cid).payload_nbytes or plen != row.payload_len \
            or ALIGN + plen > row.length:
        return "payload length"
    if payload is None:
        payload = mv[off + ALIGN:off + ALIGN + plen]
    elif cid != CodecId.RAW:
        return "codec mismatch"
    if psum != row.checksum or xxhash.xxh3_64_intdigest(payload) != psum:
        return "payload checksum"
    return int(cid)
