#!/usr/bin/env python3
"""Disk tier throughput against `dd` with O_DIRECT, the ceiling for sequential I/O on this disk.

Usage:

    python bench/disk_io.py --dir /path/on/nvme --size-mib 1024

Each repeat measures, in order: dd write (with fsync) and read, then DiskTier writing a new file
and overwriting it (each followed by `sync`, as dd's conv=fsync), each followed by a read. The
page cache is dropped before every read where permitted. The table reports medians.

Results: none recorded yet; a run goes in docs/results/scale.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierlm.memory.disk import DiskTier, aligned_empty, dd_throughput, drop_page_cache


def tier_throughput(
    tier: DiskTier, buf: torch.Tensor, dst: torch.Tensor, *, overwrite: bool
) -> tuple[float, float]:
    """(write, read) bytes/s of one DiskTier round trip of `buf`; checks the bytes came back."""
    name = "bench.bin"
    if not overwrite:
        tier.remove(name)
    else:
        tier.write_sync(name, buf)  # make sure the file exists and is fully written
    drop_page_cache()
    start_s = time.perf_counter()
    tier.write_sync(name, buf)
    tier.sync(name)
    write_s = time.perf_counter() - start_s
    drop_page_cache()
    dst.zero_()
    start_s = time.perf_counter()
    tier.read_sync(name, dst)
    read_s = time.perf_counter() - start_s
    if not torch.equal(buf, dst):
        raise RuntimeError("DiskTier read back different bytes than it wrote")
    return buf.nbytes / write_s, buf.nbytes / read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk to test (default: a temporary directory under /work)",
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--fill",
        choices=["random", "zeros"],
        default="random",
        help="DiskTier payload (dd always writes zeros)",
    )
    args = parser.parse_args()

    parent = args.dir
    if parent is None:
        parent = Path("/work") if Path("/work").is_dir() else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    size_bytes = args.size_mib << 20

    buf = aligned_empty(size_bytes, torch.uint8, pin=False)
    if args.fill == "random":
        buf.random_(0, 256)
    else:
        buf.zero_()
    dst = aligned_empty(size_bytes, torch.uint8, pin=False)

    results: dict[str, list[tuple[float, float]]] = {
        "dd (O_DIRECT)": [],
        "DiskTier, new file": [],
        "DiskTier, overwrite": [],
    }
    with tempfile.TemporaryDirectory(dir=parent, prefix="tierlm-disk-bench-") as work:
        with DiskTier(
            Path(work) / "tier", threads=args.threads, chunk_bytes=args.chunk_mib << 20
        ) as tier:
            for _ in range(args.repeats):
                results["dd (O_DIRECT)"].append(dd_throughput(Path(work), size_bytes))
                results["DiskTier, new file"].append(
                    tier_throughput(tier, buf, dst, overwrite=False)
                )
                results["DiskTier, overwrite"].append(
                    tier_throughput(tier, buf, dst, overwrite=True)
                )
            direct = tier.direct
        cache_dropped = drop_page_cache()

    medians = {
        method: (
            statistics.median(w for w, _ in runs),
            statistics.median(r for _, r in runs),
        )
        for method, runs in results.items()
    }
    dd_write, dd_read = medians["dd (O_DIRECT)"]
    print(
        f"Disk I/O, {args.size_mib} MiB in {parent}: DiskTier threads={args.threads}, "
        f"chunk={args.chunk_mib} MiB, O_DIRECT={direct}, payload={args.fill}; "
        f"page cache dropped: {cache_dropped}; median of {args.repeats}; GB = 1e9 bytes\n"
    )
    print("| method | write GB/s | read GB/s | write / dd | read / dd |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for method, (write_bps, read_bps) in medians.items():
        print(
            f"| {method} | {write_bps / 1e9:.2f} | {read_bps / 1e9:.2f} "
            f"| {write_bps / dd_write:.2f} | {read_bps / dd_read:.2f} |"
        )


if __name__ == "__main__":
    main()
