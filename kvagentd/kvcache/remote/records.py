"""Blocks as remote values: exactly the cold record of `cold/record.py` (header area, payload in
the cold tier's codec, padded), one record per value, checked on every read as a cold read is:
header checksum, key, namespace, codec, dtype, shape, payload length and payload checksum. A
value that fails any check is never decoded into a block.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvagentd.kvcache.base import BlockKey, KVGeometry
from kvagentd.kvcache.codec import CODEC_BY_ID, Codec, CodecId, make_codec
from kvagentd.kvcache.cold.record import ALIGN, check_record, header_row, pack_header, record_bytes


class RemoteRecords:
    """Encodes blocks to record bytes and verifies + decodes them back. Thread-safe (codecs
    keep workspaces, so their use is serialized)."""

    def __init__(self, geometry: KVGeometry, namespace: bytes, codec: str = "raw") -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.codec = make_codec(codec, geometry)
        self.length = record_bytes(self.codec)
        self._codecs: dict[int, Codec] = {int(self.codec.id): self.codec}
        self._lock = threading.Lock()

    def _codec_for(self, cid: int) -> Codec:
        c = self._codecs.get(cid)
        if c is None:
            c = self._codecs[cid] = CODEC_BY_ID[cid](self.geometry)
        return c

    def encode(self, key: BlockKey, block: torch.Tensor, out: bytearray | None = None
               ) -> bytearray:
        """The record of `block` (any device, `geometry.block_shape`), written into `out` (a
        buffer of `length` bytes to reuse) or a new buffer."""
        buf = out if out is not None else bytearray(self.length)
        if len(buf) != self.length:
            raise ValueError(f"a record buffer is {self.length} bytes, got {len(buf)}")
        n = self.codec.payload_nbytes
        src = block.detach().to("cpu").reshape(1, *self.geometry.block_shape)
        if self.codec.id == CodecId.RAW:
            # NOTE: one memcpy; torch's parallel copy_ is far slower on a busy CPU
            memoryview(buf)[ALIGN:ALIGN + n] = src.contiguous().view(-1).view(torch.uint8).numpy().data
        else:
            payload = torch.frombuffer(buf, dtype=torch.uint8, offset=ALIGN, count=n).view(1, n)
            with self._lock:
                self.codec.encode(src, payload)
        pack_header(buf, 0, key, self.namespace, self.geometry, self.codec,
                    memoryview(buf)[ALIGN:ALIGN + n])
        return buf

    def decode_into(self, key: BlockKey, value: bytes | bytearray | memoryview, out: torch.Tensor
                    ) -> str | None:
        """Verify `value` as the record of `key` and decode it into `out` (a CPU block);
        None when it was served, else why it was refused (and `out` is left unspecified)."""
        row = header_row(value, key)
        if row is None:
            return "short record"
        with self._lock:
            res = check_record(value, 0, row, self.namespace, self.geometry, self._codec_for)
            if isinstance(res, str):
                return res
            codec = self._codec_for(res)
            plen = codec.payload_nbytes
            if res == CodecId.RAW and out.is_contiguous():
                dst = out.view(-1).view(torch.uint8).numpy()
                dst[:] = np.frombuffer(value, dtype=np.uint8, count=plen, offset=ALIGN)
            else:
                payload = torch.frombuffer(bytearray(value[ALIGN:ALIGN + plen]),
                                           dtype=torch.uint8).view(1, plen)
                codec.decode(payload, out.view(1, *self.geometry.block_shape))
        return None
