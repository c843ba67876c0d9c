"""Host memory without an allocator tax (issue U, item 1).

torch's own buffers keep glibc's defaults (its heap reuses a freed activation's memory, no
fresh zeroed mapping per buffer and step); the runtime's host buffers are mappings of their own
that go back to the kernel when freed, so RSS still follows the ledger. Each check runs in a
fresh process: glibc's thresholds are process-wide and another test may have fixed them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "glibc" not in " ".join(
        __import__("platform").libc_ver()), reason="glibc's allocator only")

_MALLINFO = """
import ctypes
class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2
def mapped_by_malloc():  # bytes glibc serves as mappings of their own
    return _libc.mallinfo2().hblkhd
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
"""


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _MALLINFO + textwrap.dedent(script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_training_step_leaves_torchs_buffers_to_glibcs_heap(tmp_path):
    """After a trainer is set up and has stepped, a freed 4 MiB torch buffer's memory serves
    the next one from the heap. A process-wide M_MMAP_THRESHOLD (what train/safety.py set
    before) makes each such buffer a fresh mapping the kernel zero-fills: 1.25x slower steps."""
    data = tmp_path / "text.txt"
    data.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n"
                            for i in range(400)))
    out = _run("""
        import sys, torch
        from tierlm.config import from_dict
        from tierlm.train import Trainer
        cfg = from_dict({
            "model": {"size": "tiny"},
            "data": {"seq_len": 32, "vocab_size": 512, "train": sys.argv[1]},
            "train": {"max_steps": 1, "batch_size": 2, "eval_every": 0, "eval_batches": 1,
                      "sample_tokens": 0, "save_final": False},
            "memory": {"offload_policy": "none"},
            "run": {"out": sys.argv[2], "device": "cpu", "seed": 0},
        })
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.train_step()
        n = 4 << 20
        a = torch.ones(n, dtype=torch.uint8)
        del a  # glibc's default: a freed mapping raises the threshold to its size
        before = mapped_by_malloc()
        b = torch.ones(n, dtype=torch.uint8)
        print("MAPPED", mapped_by_malloc() - before)
    """, str(data), str(tmp_path / "run"))
    grew = int(out.split("MAPPED")[-1])
    assert grew < 4 << 20, f"a 4 MiB torch buffer was a fresh mapping ({grew:,} bytes mapped)"


def test_the_runtimes_host_buffers_go_back_to_the_kernel_when_freed():
    """The store's host buffers (pageable and, on a CPU, the device tier's), the pinned arena's
    blocks and the offload's host pool are mappings of their own: their pages leave RSS when
    freed, whatever glibc's heap keeps (its threshold raised here by a freed 16 MiB buffer)."""
    out = _run("""
        import gc, torch
        from tierlm.activations.offload import HostPool
        from tierlm.memory.arena import PinnedArena, PinnedBytes
        from tierlm.memory.store import Store
        from tierlm.memory.tiers import TensorClass, Tier
        big = torch.ones(16 << 20, dtype=torch.uint8)
        del big  # glibc now serves buffers up to 16 MiB from its heap, and keeps them
        n = 8 << 20
        store = Store(torch.device("cpu"))

        def held_then_back(make, drop):
            r0 = rss()
            t = make()
            t.fill_(1)
            r1 = rss()
            drop(t)
            del t
            gc.collect()
            return r1 - r0, r1 - rss()

        for tier in (Tier.HOST, Tier.DEVICE):
            print(tier.name, *held_then_back(
                lambda: store.alloc(tier, TensorClass.STAGING, n, torch.uint8),
                lambda t: store.free(tier, TensorClass.STAGING, t)))
        box = {}
        def arena_buffer():
            box["arena"] = PinnedArena(PinnedBytes(persistent_bytes=0, transient_bytes=n),
                                       pin=False)
            return box["arena"].alloc(n, torch.uint8, TensorClass.STAGING)
        def close_arena(t):
            box["arena"].free(t)
            box.pop("arena").close()
        print("ARENA", *held_then_back(arena_buffer, close_arena))
        pools = []
        def pool_buffer():
            pools.append(HostPool())
            return pools[0].take(n)
        def drop_pool(t):
            pools[0].give(t)
            pools.clear()
        print("POOL", *held_then_back(pool_buffer, drop_pool))
    """)
    rows = [line.split() for line in out.splitlines() if line.split()[0] in
            ("HOST", "DEVICE", "ARENA", "POOL")]
    assert [r[0] for r in rows] == ["HOST", "DEVICE", "ARENA", "POOL"]
    for what, held, back in rows:
        assert int(held) >= 7 << 20, (what, held)  # touched: resident
        assert int(back) >= 7 << 20, f"{what}: {int(back):,} of {int(held):,} bytes came back"
