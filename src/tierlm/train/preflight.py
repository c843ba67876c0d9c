"""Checks that refuse a run before its first step when it cannot finish (ARCHITECTURE.md
invariant 4): free disk space for the offload directory, K checkpoints and the export; host RAM
for what the placement keeps in memory; and the kernel's overcommit setting, which can let an
allocation succeed that the OOM killer ends once its pages are touched.

`Preflight` is handed to the runtime (`EngineOptions.check_placement`), which calls it with the
placement before it allocates or writes anything; the reference runtime calls it with no
placement. The numbers in every refusal are the ones it compared. On a GPU the host RAM the run
pins for PCIe copies is checked on its own too: pinned pages cannot be swapped.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tierlm.checkpoint import checkpoint_bytes, checkpoint_dir, list_checkpoints
from tierlm.config import Config, ConfigError, parse_bytes
from tierlm.memory.placement import PlacementReport, gib
from tierlm.models.export import export_dtype, source_dtype
from tierlm.train.safety import DiskSpaceError, HostMemoryError, rss_bytes

DEFAULT_HOST_FRACTION = 0.7
"""Share of the RAM available at start that the runtime's host tier may use when --host-budget
is not given; the rest is headroom for the Python/torch runtime, data and other processes."""
RUNTIME_RESERVE_BYTES = 64 << 20
"""Host RAM kept out of the runtime's share of --host-budget for what no ledger counts: torch's
kernel workspaces and thread pools, autograd temporaries, Python objects (about 40 MiB measured
for the `small` preset on a CPU-only machine)."""
OVERCOMMIT_MARGIN = 0.8
"""Warn about overcommit once the run needs more than this share of the available RAM."""
CHECKPOINT_SLACK_BYTES = 4 << 20  # tokenizer, configs, RNG and JSON files of one checkpoint


def resolve_offload_dir(offload_dir: str | None, run_dir: Path) -> Path:
    """The disk tier's directory: RUN_DIR/offload by default; a relative path is taken inside
    the run directory and may not climb out of it; an absolute path is used as given."""
    if not offload_dir:
        return run_dir / "offload"
    path = Path(offload_dir)
    if path.is_absolute():
        return path
    if ".." in path.parts:
        raise ConfigError(
            f"--offload-dir {offload_dir}: a relative offload directory lives inside the run "
            "directory and may not contain '..'; give an absolute path to put it elsewhere"
        )
    return run_dir / path


# -- host memory ----

def _cgroup_headroom_bytes() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), None without a limit."""
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controllers == "":
                candidates.append((Path("/sys/fs/cgroup") / rel.lstrip("/"), "memory.max",
                                   "memory.current"))
            elif "memory" in controllers.split(","):
                base = Path("/sys/fs/cgroup/memory")
                candidates.append((base / rel.lstrip("/"), "memory.limit_in_bytes",
                                   "memory.usage_in_bytes"))
                candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    except (OSError, ValueError):
        return None
    for root, limit_name, usage_name in candidates:
        try:
            limit_text = (root / limit_name).read_text().strip()
            usage = int((root / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # "no limit" in v2 / v1
            continue
        return max(0, int(limit_text) - usage)
    return None


def available_ram_bytes() -> int:
    """RAM this process can still get without swapping: the kernel's MemAvailable, lowered to
    the cgroup's remaining limit inside a container (where the OOM killer acts on that)."""
    available = psutil.virtual_memory().available
    headroom = _cgroup_headroom_bytes()
    return min(available, headroom) if headroom is not None else available


def default_host_budget_bytes() -> int:
    return int(available_ram_bytes() * DEFAULT_HOST_FRACTION)


def read_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by field."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def overcommit_warning(need_bytes: int, mode: int, meminfo: dict[str, int]) -> str | None:
    """Why allocating `need_bytes` may end in an OOM kill instead of an error, or None.

    vm.overcommit_memory 0 (heuristic) and 1 (always) let an allocation larger than the free
    RAM succeed: the pages are only backed when touched, and if they cannot be, the OOM killer
    ends the process with no error to catch. Mode 2 (strict) fails the allocation itself.
    """
    available = meminfo.get("MemAvailable", 0) + meminfo.get("SwapFree", 0)
    if mode == 2 or need_bytes <= OVERCOMMIT_MARGIN * available:
        return None
    kind = "always overcommits" if mode == 1 else "overcommits heuristically"
    return (
        f"vm.overcommit_memory={mode}: the kernel {kind}, so allocating the {gib(need_bytes)} "
        f"this run needs succeeds even though only {gib(available)} of RAM and swap is "
        "available; if the pages cannot be backed when touched, the OOM killer ends the run "
        "without an error. Lower --host-budget (more state goes to the disk tier) or free RAM"
    )


def _system_overcommit() -> tuple[int, dict[str, int]] | None:
    try:
        mode = int(Path("/proc/sys/vm/overcommit_memory").read_text().strip())
        return mode, read_meminfo(Path("/proc/meminfo").read_text())
    except (OSError, ValueError):
        return None


def check_host_memory(
    need_bytes: int, available_bytes: int, what: str, log: Callable[[str], None],
    overcommit: tuple[int, dict[str, int]] | None,
) -> None:
    if overcommit is not None:
        warning = overcommit_warning(need_bytes, *overcommit)
        if warning:
            log(f"WARNING: {warning}")
    if need_bytes > available_bytes:
        raise HostMemoryError(
            f"host memory: this run needs {gib(need_bytes)} of RAM ({what}) but only "
            f"{gib(available_bytes)} is available; lower --host-budget so more state goes to "
            "the disk tier, use --offload-policy disk or tiered, or free RAM"
        )


PINNED_WARN_SHARE = 0.5
"""Warn when the run pins more than this share of the machine's physical RAM."""


def check_pinned_memory(
    pinned_bytes: int, other_bytes: int, available_bytes: int, physical_bytes: int,
    log: Callable[[str], None],
) -> None:
    """Pinned pages (the run's pinned arena, tierlm.memory.arena) cannot be swapped out or
    reclaimed: refuse when they and the rest of the run's host bytes (`other_bytes`) exceed the
    RAM available, warn when they alone take more than PINNED_WARN_SHARE of the machine's."""
    if pinned_bytes <= 0:
        return
    if pinned_bytes + other_bytes > available_bytes:
        raise HostMemoryError(
            f"host memory: this run pins {gib(pinned_bytes)} of RAM for PCIe copies (pinned pages "
            f"cannot be swapped) beside {gib(other_bytes)} of other host state, but only "
            f"{gib(available_bytes)} is available; lower --host-budget so more state goes to the "
            "disk tier (which pins only its staging), use --boundary-activations device, or free "
            "RAM")
    if pinned_bytes > PINNED_WARN_SHARE * physical_bytes:
        log(f"WARNING: this run pins {gib(pinned_bytes)} of host RAM for PCIe copies, more than "
            f"{PINNED_WARN_SHARE:.0%} of the machine's {gib(physical_bytes)}; pinned pages cannot "
            "be swapped, so the rest of the system has less room. Lower --host-budget to pin less")


# -- disk ----

def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def free_disk_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class DiskNeed:
    what: str
    path: Path
    nbytes: int  # new bytes this run will write there, beyond what it already holds


def check_disk_space(needs: list[DiskNeed], free: Callable[[Path], int] | None = None) -> None:
    """Refuse when the needs that share a filesystem add up to more than its free space."""
    free = free or free_disk_bytes
    by_fs: dict[int, list[DiskNeed]] = {}
    for need in needs:
        if need.nbytes > 0:
            by_fs.setdefault(os.stat(_existing(need.path)).st_dev, []).append(need)
    problems = []
    for group in by_fs.values():
        total = sum(n.nbytes for n in group)
        available = free(group[0].path)
        if total > available:
            parts = " + ".join(f"{n.what} {gib(n.nbytes)} at {n.path}" for n in group)
            problems.append(f"needs {gib(total)} ({parts}) but {gib(available)} is free there")
    if problems:
        raise DiskSpaceError(
            "not enough disk space: " + "; ".join(problems) + ". Free space, lower "
            "--keep-checkpoints, or point --out / --offload-dir at a disk with room"
        )


# -- the whole check ----

class Preflight:
    """Called once with the placement (None for the reference runtime) before anything is
    allocated: refuses the run if its disk or host-memory needs cannot be met."""

    def __init__(
        self, cfg: Config, run_dir: Path, *, n_params: int, device_is_cpu: bool,
        optim_state_bytes: int | None = None, start_rss_bytes: int | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        """`optim_state_bytes`: the optimizer's state for the whole model
        (tierlm.optim.model_state_nbytes); default AdamW's two fp32 moments."""
        self.cfg = cfg
        self.optim_state_bytes = (8 * n_params if optim_state_bytes is None
                                  else optim_state_bytes)
        self.start_rss_bytes = start_rss_bytes if start_rss_bytes is not None else rss_bytes()
        self.run_dir = run_dir
        self.n_params = n_params
        self.device_is_cpu = device_is_cpu
        self.log = log
        self.offload_dir = resolve_offload_dir(cfg.memory.offload_dir, run_dir)

    def host_budget_bytes(self) -> int:
        """The host tier's budget for the runtime's placement.

        An explicit --host-budget is that budget as the ledger counts it (ARCHITECTURE.md
        invariant 2). Unset, the run takes 70% of the RAM available at start, and since nobody
        chose that number for the ledger it is made a cap for the whole process beyond the
        program itself (`start_rss_bytes`: Python, torch, transformers, tierlm): what the process
        already holds besides the model as built (data, tokenizer; the model's own bytes are
        freed as the runtime packs them) and a fixed reserve for what no ledger counts are
        taken off before the placement fills the rest.
        """
        if self.cfg.memory.host_budget:
            return parse_bytes(self.cfg.memory.host_budget, "--host-budget")
        budget = default_host_budget_bytes()
        held = max(0, rss_bytes() - self.start_rss_bytes - self.n_params * 4)
        share = budget - held - RUNTIME_RESERVE_BYTES
        if share <= 0:
            raise HostMemoryError(
                f"host memory: {gib(budget)} ({DEFAULT_HOST_FRACTION:.0%} of the RAM available) "
                f"leaves nothing for model state once the {gib(held)} of data and tokenizer and "
                f"a {gib(RUNTIME_RESERVE_BYTES)} reserve for torch's own buffers are counted; "
                "free RAM, or set --host-budget"
            )
        return share

    def checkpoint_estimate_bytes(self) -> int:
        """Size of one checkpoint: fp32 weights + optimizer state."""
        return self.n_params * 4 + self.optim_state_bytes + CHECKPOINT_SLACK_BYTES

    def export_estimate_bytes(self) -> int:
        """Size of the Hugging Face export: every parameter once, in the export dtype."""
        path = self.cfg.model.path
        dtype = export_dtype(self.cfg.run.export_dtype, source_dtype(path) if path else None)
        return self.n_params * dtype.itemsize

    def disk_needs(self, report: PlacementReport | None) -> list[DiskNeed]:
        train = self.cfg.train
        saves = (train.max_steps // train.save_every if train.save_every else 0) + 1
        keep = self.cfg.run.keep_checkpoints
        if not train.save_final:  # no final checkpoint, and the export is made from it
            saves -= 1
        # while a new checkpoint is written, the `keep` older ones still exist
        at_once = min(keep + 1, saves) if keep > 0 else saves
        existing = sum(checkpoint_bytes(p) for p in list_checkpoints(self.run_dir))
        needs = []
        if saves:
            needs.append(DiskNeed(f"{at_once} checkpoint(s)", checkpoint_dir(self.run_dir),
                                  at_once * self.checkpoint_estimate_bytes() - existing))
        if train.save_final:
            needs.append(DiskNeed("the Hugging Face export", self.run_dir / "hf",
                                  self.export_estimate_bytes() - dir_bytes(self.run_dir / "hf")))
        if report is not None and report.disk_bytes:
            needs.append(DiskNeed("the disk tier", self.offload_dir,
                                  report.disk_bytes - dir_bytes(self.offload_dir)))
        return needs

    def __call__(self, report: PlacementReport | None) -> None:
        check_disk_space(self.disk_needs(report))
        model_bytes = self.n_params * 4  # the model as built, before the runtime takes it over
        if report is None:
            if not self.device_is_cpu:
                return
            # weights, gradients and optimizer state in RAM; activations come on top
            need = self.n_params * 8 + self.optim_state_bytes
            what = "weights, gradients and optimizer state of the reference runtime"
            available = available_ram_bytes() + model_bytes
        else:
            need = report.host_bytes + (report.device_bytes if self.device_is_cpu else 0)
            what = f"host tier {gib(report.host_bytes)}"
            if self.device_is_cpu:
                what += f" + device tier {gib(report.device_bytes)}, which is RAM on this machine"
            # the runtime releases the built model's parameters as it packs them
            available = available_ram_bytes() + model_bytes
            if report.pinned is not None and not self.device_is_cpu:  # CPU runs pin nothing
                pinned = report.pinned.total_bytes
                check_pinned_memory(pinned, max(0, need - pinned), available,
                                    psutil.virtual_memory().total, self.log)
        check_host_memory(need, available, what, self.log, _system_overcommit())
