from __future__ import annotations

import pytest
import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.codec import make_codec

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=8, dtype=torch.float32)
BOUNDS = {"raw": 0.0, "int8": 0.01, "fp8": 0.05}  # relative L2 error on Gaussian data


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / a.float().norm()).item()


@pytest.mark.parametrize("name", ["raw", "int8", "fp8"])
def test_round_trip_error_within_bounds(name):
    torch.manual_seed(0)
    x = torch.randn(5, *GEOM.block_shape)
    x[:, :, 0] *= torch.linspace(0.1, 5.0, GEOM.head_dim)  # K channels with different ranges
    c = make_codec(name, GEOM)
    p = torch.empty(5, c.payload_nbytes, dtype=torch.uint8)
    c.encode(x, p)
    out = torch.empty_like(x)
    c.decode(p, out)
    err = _rel(x, out)
    assert err <= BOUNDS[name]
    if name == "raw":
        assert torch.equal(x, out)
    else:
        assert c.payload_nbytes < GEOM.block_bytes / 2


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_codecs_keep_zero_blocks_and_extremes(name):
    c = make_codec(name, GEOM)
    x = torch.zeros(2, *GEOM.block_shape)
    x[1, 0, 0, 0, 0, 0] = 1e4
    p = torch.empty(2, c.payload_nbytes, dtype=torch.uint8)
    c.encode(x, p)
    out = torch.full_like(x, 7.0)
    c.decode(p, out)
    assert out[0].eq(0).all()
    assert out[1, 0, 0, 0, 0, 0].item() == pytest.approx(1e4, rel=1e-3)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["raw", "int8", "fp8"])
def test_strided_payload_rows_and_bf16_output(name):
    g = KVGeometry(2, 1, 8, 4, torch.bfloat16)
    c = make_codec(name, g)
    x = torch.randn(3, *g.block_shape).to(torch.bfloat16)
    buf = torch.zeros(3, c.payload_nbytes + 4096, dtype=torch.uint8)
    c.encode(x, buf[:, 4096:])
    out = torch.empty_like(x)
    c.decode(buf[:, 4096:], out)
    assert _rel(x, out) <= max(BOUNDS[name], 0.01)


def test_unknown_codec():
    with pytest.raises(ValueError):
        make_codec("zstd", GEOM)
