"""Codecs for cold blocks: raw, int8 and fp8 (e4m3), vectorized over batches of blocks.

Every codec maps a batch of blocks `(N, *block_shape)` to a batch of fixed-size payloads
`(N, payload_nbytes)` of uint8 and back, with plain tensor arithmetic (no pickle, nothing that
can execute stored data). Payload of one block, little-endian:

  raw:   the block's bytes in its own dtype
  int8:  int8 values (block_shape) | K scales f32 (layers, heads, 1, head_dim)  [per channel]
                                   | V scales f32 (layers, heads, tokens, 1)    [per token]
  fp8:   e4m3 bytes (block_shape)  | same scales as int8

Quantized codecs compute in float32 and decode into the destination dtype. Not thread-safe
(each codec object keeps a reusable float32 workspace); the cold store serializes its use.
"""

from __future__ import annotations

import enum

import torch

from kvagentd.kvcache.base import KVGeometry

_INF_GUARD = 1e-30
_FP8_MAX = 448.0


class CodecId(enum.IntEnum):
    RAW = 0
    INT8 = 1
    FP8 = 2


class Codec:
    """Base: raw bytes. Subclasses quantize."""

    id = CodecId.RAW
    name = "raw"

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.shape = geometry.block_shape
        self.numel = geometry.block_numel
        self._work: torch.Tensor | None = None

    @property
    def payload_nbytes(self) -> int:
        return self.geometry.block_bytes

    def encode(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """`blocks` (N, *block_shape) CPU -> `out` (N, payload_nbytes) uint8 (may be strided)."""
        n = blocks.shape[0]
        out.view(n, -1).copy_(blocks.reshape(n, -1).view(torch.uint8))

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """`payload` (N, payload_nbytes) uint8 -> `out` (N, *block_shape) CPU, any float dtype."""
        n = payload.shape[0]
        out.view(n, -1).view(torch.uint8).copy_(payload.reshape(n, -1)) if out.is_contiguous() \
            else out.copy_(payload.reshape(n, -1).view(out.dtype).view(out.shape))

    def _workspace(self, n: int) -> torch.Tensor:
        if self._work is None or self._work.shape[0] < n:
            self._work = torch.empty((n, *self.shape), dtype=torch.float32)
        return self._work[:n]


class _ScaledCodec(Codec):
    """K scaled per channel (reduced over tokens), V scaled per token (reduced over head_dim)."""

    qmax = 127.0
    qdtype = torch.int8

    @property
    def _ks_n(self) -> int:
        g = self.geometry
        return g.num_layers * g.num_kv_heads * g.head_dim

    @property
    def _vs_n(self) -> int:
        g = self.geometry
        return g.num_layers * g.num_kv_heads * g.block_tokens

    @property
    def payload_nbytes(self) -> int:
        return self.numel + 4 * (self._ks_n + self._vs_n)

    def _views(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = payload.shape[0]
        g = self.geometry
        L, H, T, D = g.num_layers, g.num_kv_heads, g.block_tokens, g.head_dim
        q = payload[:, :self.numel].view(self.qdtype).view(n, *self.shape)
        a = self.numel
        ks = payload[:, a:a + 4 * self._ks_n].view(torch.float32).view(n, L, H, 1, D)
        a += 4 * self._ks_n
        vs = payload[:, a:a + 4 * self._vs_n].view(torch.float32).view(n, L, H, T, 1)
        return q, ks, vs

    def encode(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        n = blocks.shape[0]
        q, ks, vs = self._views(out)
        if blocks.dtype != torch.float32:
            blocks = blocks.float()
        w = self._workspace(n)
        torch.abs(blocks, out=w)
        torch.amax(w[:, :, 0], dim=3, keepdim=True, out=ks)
        torch.amax(w[:, :, 1], dim=4, keepdim=True, out=vs)
        ks.clamp_(min=_INF_GUARD).div_(self.qmax)
        vs.clamp_(min=_INF_GUARD).div_(self.qmax)
        torch.div(blocks[:, :, 0], ks, out=w[:, :, 0])
        torch.div(blocks[:, :, 1], vs, out=w[:, :, 1])
        self._store(w, q)

    def _store(self, w: torch.Tensor, q: torch.Tensor) -> None:
        w.round_()
        q.copy_(w)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        q, ks, vs = self._views(payload)
        if out.dtype == torch.float32 and out.is_contiguous():
            self._load(q, out)
            out[:, :, 0].mul_(ks)
            out[:, :, 1].mul_(vs)
            return
        w = self._workspace(out.shape[0])
        self._load(q, w)
        w[:, :, 0].mul_(ks)
        w[:, :, 1].mul_(vs)
        out.copy_(w)

    def _load(self, q: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(q)


class Int8Codec(_ScaledCodec):
    id = CodecId.INT8
    name = "int8"


class Fp8Codec(_ScaledCodec):
    """e4m3 (torch.float8_e4m3fn) with the same scales, max 448. Decoding looks up byte pairs
    in a 65536-entry table of float pairs: several times faster on CPU than torch's
    float8 -> float32 conversion."""

    id = CodecId.FP8
    name = "fp8"
    qmax = _FP8_MAX
    qdtype = torch.float8_e4m3fn

    def __init__(self, geometry: KVGeometry) -> None:
        super().__init__(geometry)
        if self.numel % 2:
            raise ValueError("fp8 codec needs an even number of values per block")
        single = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        single = torch.nan_to_num(single, nan=0.0)
        lo = torch.arange(65536) & 0xFF  # little-endian: first byte is the low byte
        hi = torch.arange(65536) >> 8
        self._pairs = torch.stack([single[lo], single[hi]], dim=1).contiguous().view(torch.int64).view(-1)
        self._f8: torch.Tensor | None = None
        self._idx: torch.Tensor | None = None

    def _store(self, w: torch.Tensor, q: torch.Tensor) -> None:
        n = w.shape[0]
        if self._f8 is None or self._f8.shape[0] < n:
            self._f8 = torch.empty((n, self.numel), dtype=torch.float8_e4m3fn)
        f8 = self._f8[:n]
        f8.view(w.shape).copy_(w)
        q.view(n, -1).view(torch.uint8).copy_(f8.view(torch.uint8))

    def _load(self, q: torch.Tensor, out: torch.Tensor) -> None:
        n = q.shape[0]
        if self._idx is None or self._idx.shape[0] < n:
            self._idx = torch.empty((n, self.numel // 2), dtype=torch.int32)
        idx = self._idx[:n]
        idx.copy_(q.reshape(n, -1).view(torch.uint8).view(torch.int16))
        idx.bitwise_and_(0xFFFF)
        torch.index_select(self._pairs, 0, idx.view(-1), out=out.view(-1).view(torch.int64))


CODECS: dict[str, type[Codec]] = {"raw": Codec, "int8": Int8Codec, "fp8": Fp8Codec}
CODEC_BY_ID: dict[int, type[Codec]] = {c.id: c for c in CODECS.values()}


def make_codec(name: str, geometry: KVGeometry) -> Codec:
    """Codec by config name ("raw", "int8", "fp8"); raises ValueError for others."""
    try:
        return CODECS[name](geometry)
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None
