"""Disk tier: aligned buffers, bitwise round trips, O_DIRECT fallback and clear errors."""

import errno
import os
import re
import threading

import pytest
import torch

from tierlm.memory.disk import (
    ALIGN_BYTES,
    DiskFullError,
    DiskIOError,
    DiskTier,
    aligned_empty,
    supports_direct_io,
)

ODD_NUMELS = [1, 1023, 3 * 2**20 + 5]


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _random(numel: int, dtype: torch.dtype, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Random values plus the specials a float compare would miss (nan, infs, -0.0)."""
    out = torch.empty(numel, dtype=dtype) if buf is None else buf
    out.copy_(torch.randn(numel).to(dtype))
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    out[: min(numel, 4)] = specials[: min(numel, 4)]
    return out


def _buffer(tier: DiskTier, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if tier.direct:
        return aligned_empty(numel, dtype)
    # Buffered I/O takes any contiguous tensor: use a deliberately misaligned one.
    return torch.empty(numel + 1, dtype=dtype)[1:]


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def tier(request, tmp_path):
    if request.param and not supports_direct_io(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    with DiskTier(tmp_path / "tier", direct=request.param, chunk_bytes=1 << 20) as t:
        assert t.direct is request.param
        yield t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 1024, 2048, 4097, 3 * 2**20 + 5])
def test_aligned_empty_is_aligned_and_padded(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGN_BYTES == 0
    storage = t.untyped_storage()
    room_bytes = storage.data_ptr() + storage.nbytes() - t.data_ptr()
    assert room_bytes >= _round_up(max(t.nbytes, 1))
    t.fill_(1)  # the memory is usable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", ODD_NUMELS)
def test_round_trip_is_bitwise(tier, numel, dtype):
    src = _random(numel, dtype, _buffer(tier, numel, dtype))
    tier.write_sync("state.bin", src)
    dst = _buffer(tier, numel, dtype)
    dst.fill_(7)
    tier.read_sync("state.bin", dst)
    assert torch.equal(_bits(dst), _bits(src))
    size = (tier.root / "state.bin").stat().st_size
    assert size == (_round_up(src.nbytes) if tier.direct else src.nbytes)


@pytest.mark.parametrize("numel", ODD_NUMELS)
def test_read_never_writes_past_dst(tier, numel):
    """A destination carved out of a larger buffer keeps its neighbour's bytes intact."""
    big = _buffer(tier, numel + 4096, torch.float32).fill_(-1.0)
    src = _random(numel, torch.float32, _buffer(tier, numel, torch.float32))
    tier.write_sync("w", src)
    tier.read_sync("w", big[:numel])
    assert torch.equal(_bits(big[:numel]), _bits(src))
    assert bool((big[numel:] == -1.0).all())


def test_chunk_size_not_a_multiple_of_alignment(tmp_path):
    with DiskTier(tmp_path, chunk_bytes=5000, threads=3) as tier:
        assert tier.chunk_bytes % ALIGN_BYTES == 0
        src = _random(100_003, torch.float32, aligned_empty(100_003, torch.float32))
        tier.write_sync("x", src)
        dst = aligned_empty(100_003, torch.float32)
        tier.read_sync("x", dst)
        assert torch.equal(_bits(dst), _bits(src))


def test_concurrent_requests_on_different_files(tier):
    numels = [50_000 + 777 * i for i in range(8)]
    srcs = [_random(n, torch.float32, _buffer(tier, n, torch.float32)) for n in numels]
    futs = [tier.write(f"seg{i}", s) for i, s in enumerate(srcs)]  # all in flight at once
    for fut in futs:
        fut.result()
    dsts = [_buffer(tier, s.numel(), torch.float32) for s in srcs]
    futs = [tier.read(f"seg{i}", d) for i, d in enumerate(dsts)]
    for fut in futs:
        fut.result()
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(_bits(s), _bits(d))


def test_overwrite_replaces_content_and_length(tier):
    big = _random(300_001, torch.bfloat16, _buffer(tier, 300_001, torch.bfloat16))
    small = _random(1_001, torch.bfloat16, _buffer(tier, 1_001, torch.bfloat16))
    tier.write_sync("m", big)
    tier.write_sync("m", small)
    assert (tier.root / "m").stat().st_size == (_round_up(2_002) if tier.direct else 2_002)
    dst = _buffer(tier, 1_001, torch.bfloat16)
    tier.read_sync("m", dst)
    assert torch.equal(_bits(dst), _bits(small))
    tier.sync("m")


def test_parts_at_offsets_keep_the_rest_of_the_file(tier):
    # a file written chunk by chunk (the runtime's staging), the last part ending unaligned
    n, part = 5 * 1024 + 7, 2 * 1024  # fp32 elements: parts are 8 KiB, O_DIRECT-aligned
    whole = _random(n, torch.float32, _buffer(tier, n, torch.float32))
    for lo in range(0, n, part):
        tier.write("parts", _copy_aligned(whole[lo : lo + part]), lo * 4).result()
    new = _copy_aligned(_random(part, torch.float32) + 1)
    tier.write("parts", new, part * 4).result()  # rewrite the middle part only
    expect = whole.clone()
    expect[part : 2 * part] = new
    back = _buffer(tier, n, torch.float32)
    tier.read_sync("parts", back)
    assert torch.equal(_bits(back), _bits(expect))
    tail = _buffer(tier, n - 2 * part, torch.float32)
    tier.read("parts", tail, 2 * part * 4).result()
    assert torch.equal(_bits(tail), _bits(expect[2 * part :]))
    with pytest.raises(ValueError, match="multiple of 4096"):
        tier.read("parts", tail, 100)


def _copy_aligned(t: torch.Tensor) -> torch.Tensor:
    return aligned_empty(t.numel(), t.dtype).copy_(t)


def test_zero_elements(tier):
    tier.write_sync("empty", _buffer(tier, 0, torch.float32))
    assert (tier.root / "empty").exists()
    tier.read_sync("empty", _buffer(tier, 0, torch.float32))


def test_direct_rejects_unaligned_buffer(tmp_path):
    if not supports_direct_io(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    with DiskTier(tmp_path, direct=True) as tier:
        with pytest.raises(ValueError, match="aligned_empty"):
            tier.write("x", torch.empty(1025)[1:])


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_probe_falls_back_when_filesystem_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    assert not supports_direct_io(tmp_path)
    with DiskTier(tmp_path, direct=None) as tier:
        assert tier.direct is False
        src = _random(10_001, torch.float32)
        tier.write_sync("a", src)
        dst = torch.empty_like(src)
        tier.read_sync("a", dst)
        assert torch.equal(_bits(dst), _bits(src))
    with pytest.raises(DiskIOError, match="O_DIRECT"):
        DiskTier(tmp_path, direct=True)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no probe file left behind


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("syscall", ["posix_fallocate", "pwritev"])
def test_disk_full_names_path_and_flag(tier, monkeypatch, syscall):
    monkeypatch.setattr(os, syscall, _enospc)
    fut = tier.write(
        "opt_state", _random(5_000, torch.float32, _buffer(tier, 5_000, torch.float32))
    )
    with pytest.raises(DiskFullError) as info:
        fut.result()
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(tier.root / "opt_state") in msg
    assert "--offload-dir" in msg
    assert re.search(r"needs \d+ bytes but \d+ bytes are free", msg), msg
    assert tier.bytes_written == 0
    tier.remove("opt_state")  # the failed request is no longer in flight


def test_other_write_error_is_disk_io_error(tier, monkeypatch):
    def eio(*_args, **_kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", eio)
    fut = tier.write("g", _buffer(tier, 3 * 2**20, torch.float32).zero_())  # several chunks
    with pytest.raises(DiskIOError, match=re.escape(str(tier.root / "g"))) as info:
        fut.result()
    assert "write" in str(info.value) and info.value.errno == errno.EIO


def test_read_missing_file_names_it(tier):
    with pytest.raises(DiskIOError, match=re.escape(str(tier.root / "nope.bin"))):
        tier.read_sync("nope.bin", _buffer(tier, 10, torch.float32))
    assert not (tier.root / "nope.bin").exists()


def test_read_short_file_names_it(tier):
    tier.write_sync("short.bin", _buffer(tier, 100, torch.float32).zero_())
    with pytest.raises(DiskIOError, match=re.escape(str(tier.root / "short.bin"))):
        tier.read_sync("short.bin", _buffer(tier, 5_000, torch.float32))


def test_counters_add_up(tier):
    numels = [1, 1023, 200_000, 3 * 2**20 + 5]
    srcs = [_random(n, torch.bfloat16, _buffer(tier, n, torch.bfloat16)) for n in numels]
    for i, s in enumerate(srcs):
        tier.write_sync(f"c{i}", s)
    for i, s in enumerate(srcs):
        tier.read_sync(f"c{i}", _buffer(tier, s.numel(), torch.bfloat16))
    total = sum(s.nbytes for s in srcs)
    assert tier.bytes_written == total and tier.bytes_read == total
    assert tier.write_busy_s > 0 and tier.read_busy_s > 0


def test_remove_and_close(tmp_path):
    tier = DiskTier(tmp_path)
    tier.write_sync("r", aligned_empty(10, torch.float32).zero_())
    tier.remove("r")
    assert not (tmp_path / "r").exists()
    tier.remove("r")  # already gone: no error
    with pytest.raises(DiskIOError, match=re.escape(str(tmp_path / "r"))):
        tier.read_sync("r", aligned_empty(10, torch.float32))
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.write("r", aligned_empty(10, torch.float32))


def test_names_stay_inside_root(tmp_path):
    with DiskTier(tmp_path) as tier:
        tier.write_sync("block3/master", aligned_empty(10, torch.float32).zero_())
        assert (tmp_path / "block3" / "master").exists()
        for bad in ["../escape", "/abs", ""]:
            with pytest.raises(ValueError):
                tier.write(bad, aligned_empty(10, torch.float32))


def test_remove_refuses_while_a_request_is_in_flight(tmp_path, monkeypatch):
    gate = threading.Event()
    real_pwritev = os.pwritev

    def gated_pwritev(*args):
        gate.wait(10)
        return real_pwritev(*args)

    with DiskTier(tmp_path) as tier:
        monkeypatch.setattr(os, "pwritev", gated_pwritev)  # after the O_DIRECT probe
        fut = tier.write("busy", aligned_empty(10, torch.float32).zero_())
        with pytest.raises(RuntimeError, match="in flight"):
            tier.remove("busy")
        gate.set()
        fut.result()
        tier.remove("busy")
