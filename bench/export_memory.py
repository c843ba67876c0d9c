#!/usr/bin/env python3
"""`tierlm export` needs a chunk of RAM, not the model: peak RSS of the old and the streamed export.

One checkpoint (a preset's fp32 weights, one model file per segment as the tiered runtime writes
them) is exported by each path in a fresh subprocess, the paths interleaved round by round:

- old: what `tierlm export` did before streaming: build the model in RAM from config.json, copy
  every checkpoint tensor into it, `export_hf` (`save_pretrained`: one fp32 model.safetensors);
- streamed: `tierlm export` now (`cli.commands.export_checkpoint`: `export_hf_from_checkpoint`,
  which the end of a run calls too), float32 and bfloat16.

Peak RSS is VmHWM from /proc/self/status, reset (`echo 5 > /proc/self/clear_refs`) right before
the export, after imports (and one build of the model on the meta device, which imports the
model's code); `rise` is that peak minus the RSS just before the export (the imports' memory,
the same for every path, is not the export's). Ratios are old over streamed.

    python bench/export_memory.py --model-size 125m

Results: docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MAKE = r"""
import re, sys
from pathlib import Path
import torch
from tierlm.models import build_model, preset_config
from tierlm.checkpoint import TrainState, save_checkpoint

size, run = sys.argv[1], Path(sys.argv[2])
model = build_model(preset_config(size), seed=0)
shards = {}
for name, p in model.named_parameters():
    m = re.search(r"layers\.(\d+)\.", name)
    seg = f"block.{m.group(1)}" if m else ("embed" if "embed" in name else "head")
    shards.setdefault(seg, {})[name] = p.detach()
state = TrainState(step=1, sampler={"epoch": 0, "index": 0}, run_config={},
                   source_dtype="float32")
ckpt = save_checkpoint(run, shards=[(k, v, {}) for k, v in shards.items()],
                       model_config=model.config, tokenizer=None, state=state)
print(ckpt)
"""

CHILD = r"""
import ctypes, gc, json, sys, time
from pathlib import Path
import torch
from transformers import AutoConfig
from tierlm.models import build_model, export_hf
from tierlm.checkpoint import check_weight_names, load_checkpoint

mode, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

# both paths build the model class (the streamed one on the meta device, to check names and
# shapes): import its code first, so the rise is the export's own memory, not an import's
build_model(AutoConfig.from_pretrained(str(ckpt)), device="meta")
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
t0 = time.perf_counter()
if mode == "old":  # cli._export before streaming (the checkpoint carries no tokenizer)
    model = build_model(AutoConfig.from_pretrained(str(ckpt)), device="cpu")
    weights, _, _ = load_checkpoint(ckpt)
    params = dict(model.named_parameters())
    check_weight_names({n: tuple(p.shape) for n, p in params.items()}, weights, ckpt)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    export_hf(model, None, out)
else:  # what `tierlm export CHECKPOINT OUT --export-dtype D` runs
    from tierlm.cli.commands import export_checkpoint
    export_checkpoint(str(ckpt), str(out), mode.split("-")[1])
seconds = time.perf_counter() - t0
print(json.dumps({"peak": status("VmHWM"), "rise": status("VmHWM") - before,
                  "seconds": seconds,
                  "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
                  "files": len(list(out.glob("*.safetensors")))}))
"""

MODES = ("old", "streamed-float32", "streamed-bfloat16")
MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", default="125m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="export-bench-", dir=args.dir))
    try:
        ckpt = Path(subprocess.run(
            [sys.executable, "-c", MAKE, args.model_size, str(work / "run")],
            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("model*.safetensors"))
        results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                out = work / f"hf-{mode}"
                proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(ckpt), str(out)],
                                      check=True, capture_output=True, text=True)
                results[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {m: {k: min(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    print(f"`tierlm export` of a {args.model_size} checkpoint ({ckpt_bytes / MiB:.0f} MiB of "
          f"fp32 weights), best of {args.rounds} interleaved rounds, each in a fresh process")
    print()
    print("| path | peak RSS (MiB) | rise over start (MiB) | seconds | output (MiB) | files |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in MODES:
        b = best[m]
        print(f"| {m} | {b['peak'] / MiB:.0f} | {b['rise'] / MiB:.0f} | {b['seconds']:.2f} | "
              f"{b['bytes'] / MiB:.0f} | {b['files']:.0f} |")
    print()
    old = best["old"]
    for m in MODES[1:]:
        print(f"old / {m}: peak RSS {old['peak'] / best[m]['peak']:.2f}x, rise "
              f"{old['rise'] / max(best[m]['rise'], 1):.1f}x, time "
              f"{old['seconds'] / best[m]['seconds']:.2f}x")


if __name__ == "__main__":
    main()
