"""The plan in words: `tierlm plan`'s description, the flags that reproduce a plan, and the
ledger's predicted peaks."""

from __future__ import annotations

from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    gib,
    keeps_graph,
)
from tierlm.plan.evaluate import (
    SIMULATED_LANES,
    simulated_lanes,
    simulation_gap,
    spare_disk_bytes,
)
from tierlm.plan.result import SAFETY_MARGIN, Plan
from tierlm.plan.timing import compiled_block_source, grad_sync_bytes, ring_kv_bytes
from tierlm.runtime.shapes import ModelShape, TrainShape


def describe(
    p: Plan, shape: ModelShape, train: TrainShape, hw: HardwareProfile,
    run_flags: list[str] | None = None,
) -> str:
    lines = []
    n = shape.n_params
    emb = shape.numels[0]
    lines.append(f"model: {n / 1e9:.2f}B params ({shape.n_layers} blocks; embed "
                 f"{emb / 1e6:.0f}M, blocks {sum(shape.numels[1:-1]) / 1e9:.2f}B, head "
                 f"{shape.numels[-1] / 1e6:.0f}M{', tied' if shape.tied_numel else ''})")
    if shape.frozen:  # --finetune lora/qlora: a frozen base and the trained adapters
        base = sum(MASTER_B * shape.numels[s] if shape.base_copy(s) is None
                   else shape.base_copy(s) for s in range(len(shape.numels)))
        t, optim = shape.trained_numel, shape.trained_optim_bytes
        lines.append(f"model state by class: frozen base {gib(base)}; adapters "
                     f"{t / 1e6:.1f}M params: master {gib(MASTER_B * t)}, gradients "
                     f"{gib(GRAD_B * t)}, {shape.optim_name} state {gib(optim)} "
                     f"({optim / max(t, 1):.2f} B/param)  (all of it in one place needs "
                     f"{gib(base + (MASTER_B + GRAD_B) * t + optim)} + activations)")
    else:
        optim = sum(shape.optim_state_bytes)
        lines.append(f"model state by class: compute/master {gib(MASTER_B * n)}, gradients "
                     f"{gib(GRAD_B * n)}, {shape.optim_name} state {gib(optim)} "
                     f"({optim / n:.2f} B/param)  (all of it in one place needs "
                     f"{gib((MASTER_B + GRAD_B) * n + optim)} + activations)")
    lines.append(f"hardware: {hw.name}; budgets after a {SAFETY_MARGIN:.0%} margin: device "
                 f"{gib(p.budgets['device'])}, host {gib(p.budgets['host'])}, disk "
                 f"{gib(p.budgets['disk'])}")
    cp = train.context_parallel
    share = (f" per rank (context parallel {cp}: rows of {cp * train.seq_len})" if cp > 1
             else "")
    precision = train.precision
    if precision == "fp32" and not hw.device_is_cpu:
        rate = hw.fp32_compute_flops(tf32=train.tf32) / 1e12
        precision += (f" (TF32 tensor cores, {rate:.0f} TFLOPS peak)" if train.tf32 else
                      f" (IEEE, {rate:.0f} TFLOPS peak; --tf32 for the tensor cores)")
    lines.append(f"step: {train.micro_batches} x {train.batch_size} x {train.seq_len} "
                 f"tokens{share}, {precision}, micro-batch order {p.order}")
    compiled = compiled_block_source(train, hw)
    if compiled:
        lines.append(compiled)
    lines.append("")
    lines.append("peak bytes per tier (by tensor class):")
    for tier, total, classes in (
        ("device", p.device_peak_bytes, p.device_by_class),
        ("host", p.host_peak_bytes, p.host_by_class),
        ("disk", p.disk_bytes, p.disk_by_class),
    ):
        parts = ", ".join(f"{c} {gib(v)}" for c, v in classes.items())
        lines.append(f"  {tier:6s} {gib(total):>10s}  ({parts})")
    if hw.memory_node is not None:
        lines.append(f"  memory node {gib(p.remote_bytes):>10s}  of its usable "
                     f"{gib(p.budgets['remote'])} (master, slots, gradient sum and compute copy "
                     f"of the remote segments, with its receive staging)")
    lines.append(f"  + device activation workspace {gib(p.workspace_bytes)} -> device total "
                 f"{gib(p.device_total_bytes)}")
    pinned = ", ".join(f"{c} {gib(v)}" for c, v in p.pinned_by_class.items())
    lines.append(f"  of host, pinned for PCIe copies {gib(p.pinned_peak_bytes)} at peak"
                 + (f" ({pinned})" if pinned else "")
                 + f", in one arena of {gib(p.pinned_arena_bytes)} (4 KiB units)"
                 if p.pinned_arena_bytes else "  of host, pinned for PCIe copies: nothing")
    counts = p.tier_counts()
    resident = p.resident_names()
    lines.append("")
    remote = sum(q.remote for q in p.placements)
    on_node = f" ({remote} of them with master and slots on the memory node)" if remote else ""
    lines.append(f"placement: state on device {counts['device']}, host {counts['host']}"
                 f"{on_node}, disk "
                 f"{counts['disk']} of {len(p.placements)} segments; compute weights resident: "
                 f"{_short(resident)}; streamed: {len(p.placements) - len(resident)}")
    if hw.memory_node is not None:
        lines.append(_node_line(p, shape, train, hw))
    host_grads = sum(pl.host_grad for pl in p.placements)
    if counts["disk"]:
        ra = ("off" if p.readahead is None else
              f"{len(p.readahead_segments)} segments' master and slots "
              f"({gib(sum(shape.update_state_bytes(s) for s in p.readahead_segments))}) read "
              f"during the backward, up to {gib(p.readahead.extra_bytes)} beyond what it frees")
        wb = ("inside the update" if p.writeback is None else
              f"behind the step, up to {p.writeback.segments} segments pending")
        lines.append(f"disk tier: gradients of {host_grads} of {counts['disk']} segments held in "
                     f"host RAM; update read-ahead: {ra}; master and slots written back {wb}")
        spec = _speculation_line(p, shape, train)
        if spec:
            lines.append(spec)
    keeps = keeps_graph(p.placements, p.keep_resident_activations)
    streamed = [s for s, q in enumerate(p.placements[:-1]) if not q.resident]
    streamed_keep = sum(keeps[s] for s in streamed)
    offloaded = sum(s < len(p.offload_graphs) and p.offload_graphs[s] for s in streamed)
    lines.append(f"activations: resident segments "
                 f"{'keep their graph' if p.keep_resident_activations else 'recompute'}, "
                 + (f"of {len(streamed)} streamed segments {streamed_keep} keep their graph, "
                    f"{offloaded} offload their saved tensors to host RAM, "
                    f"{len(streamed) - streamed_keep - offloaded} recompute from their boundary "
                    "input (the choice per segment by the simulated step)" if offloaded
                    else "streamed segments recompute from their boundary input"
                    if not streamed_keep
                    else f"{streamed_keep} of {len(streamed)} streamed segments keep theirs "
                    "(the last; the others recompute from their boundary input)")
                 + "; boundary activations wait on the "
                 + ("host" if p.boundary_on_host else "device"))
    t = p.times_s
    lines.append("")
    decode = f" incl. NF4 decode {t['decode']:.2f}" if t.get("decode") else ""
    behind = (f", of which the write-back {t['writeback']:.2f} drains behind the step"
              if t["writeback"] else "")
    simulated = "estimate" in t  # the prediction is the simulated step (plan.adopt_simulated)
    if simulated:
        busy = ", ".join(f"{lane} {t[f'simulated_{key}']:.2f}"
                         for key, lane in simulated_lanes(hw).items() if t[f"simulated_{key}"])
        lines.append(f"predicted step: {t['step']:.2f} s, the engine's operations in issue "
                     f"order on a simulated {hw.name} ({t['step'] / t['simulated_compute']:.2f}x "
                     f"its compute {t['simulated_compute']:.2f}); lanes busy: {busy}; compute "
                     f"waiting for copies {t['simulated_transfer_wait']:.2f}")
    estimate = t["estimate"] if simulated else t["step"]
    label = "  the search's estimate" if simulated else "predicted step"
    lines.append(f"{label}: {estimate:.2f} s = sweep max(compute {t['compute']:.2f}"
                 f"{decode}, "
                 f"H2D {t['h2d']:.2f}, D2H {t['d2h']:.2f}, disk {t['sweep_disk']:.2f}) "
                 f"+ update stall {t['update_stall']:.2f} (the update, {t['update']:.2f} s = "
                 f"CPU {shape.optim_name} {t['cpu_update']:.2f} + disk "
                 f"{t['update_disk']:.2f}{behind}{_node_update(t)}, runs behind the next "
                 f"step's first forward ({t['update_window']:.2f} s); one disk serves sweep "
                 f"and update: {t['disk']:.2f} s)"
                 + (" (a closed form that grows each variant's placement; the variants that "
                    "fit are ranked by their simulated step)" if simulated else ""))
    if cp > 1 or train.nproc > 1:
        kv = ring_kv_bytes(shape, train, p.placements, p.keep_resident_activations)
        ring = (f"ring K/V {gib(kv)} sent per rank per step = {t['net']:.2f} s, overlapping "
                f"attention {t['attention']:.2f} s" if cp > 1 else "")
        how = "dense fp32" if train.grad_sync is None else train.grad_sync.summary()
        grads = (f"gradient sync ({how} over {train.nproc} ranks) "
                 f"{gib(grad_sync_bytes(shape, train))} per rank per step = "
                 f"{t['grad_sync']:.2f} s, {t['grad_sync_exposed']:.2f} s of it waited for"
                 if train.nproc > 1 else "")
        lines.append(f"  + net lane {t['net_lane']:.2f} s in the sweep's max, at "
                     f"{hw.net_Bps / 1e9:.1f} GB/s: " + "; ".join(x for x in (ring, grads) if x))
    gap = simulation_gap(shape, train, hw)
    if "simulated_step" in t and not simulated:
        busy = ", ".join(f"{lane} {t[f'simulated_{key}']:.2f}"
                         for key, lane in SIMULATED_LANES.items() if t[f"simulated_{key}"])
        lines.append(f"simulated step without {gap}: {t['simulated_step']:.2f} s "
                     f"({t['simulated_step'] / max(t['simulated_compute'], 1e-30):.2f}x its "
                     f"compute {t['simulated_compute']:.2f}); lanes busy: {busy}; compute "
                     f"waiting for copies {t['simulated_transfer_wait']:.2f} (the prediction "
                     f"above prices {gap}, which the simulator does not yet)")
    bound = t["simulated_compute"] if simulated else t["compute"]
    lines.append(f"tokens/s: {p.tokens_per_s:,.0f}; bottleneck: {p.bottleneck}; lower bound "
                 f"{bound:.2f} s (the step's compute at the profile's rate, "
                 f"{train.tokens_per_step / bound:,.0f} tokens/s): predicted step "
                 f"{p.step_over_bound:.2f}x of it")
    lines.append("moved per step: " + ", ".join(
        f"{k} {gib(v)}" for k, v in p.moved_bytes.items() if v))
    lines.append("")
    if p.fits:
        lines.append("fits. Train with: tierlm train " + " ".join((run_flags or []) + flags(p)))
    else:
        lines.append("DOES NOT FIT: " + "; ".join(p.problems))
    return "\n".join(lines)


def _node_update(t: dict[str, float]) -> str:
    """The remote segments' part of the update in the estimate (empty without a node)."""
    if not t.get("node_send"):  # no node, or none of the state on it
        return ""
    return (f" + memory node {t['node_send'] + t['node_cpu'] + t['node_recv']:.2f} (gradients "
            f"sent {t['node_send']:.2f}, its update {t['node_cpu']:.2f}, copies back "
            f"{t['node_recv']:.2f})")


def _node_line(p: Plan, shape: ModelShape, train: TrainShape, hw: HardwareProfile) -> str:
    """The memory node in the plan: which segments it holds, against its memory, the bytes
    each way per step and the time each of its lanes is busy."""
    node = hw.memory_node
    assert node is not None
    remote = [name for name, q in zip(p.names, p.placements, strict=True) if q.remote]
    if not remote:
        return (f"memory node: no segment's state placed there (usable "
                f"{gib(p.budgets['remote'])}; the device and host RAM hold the plan's state"
                + (" and disk the rest)" if p.disk_bytes else ")"))
    t = p.times_s
    sim = "simulated_net_send" in t
    send, recv, cpu = ((t["simulated_net_send"], t["simulated_net_recv"],
                        t["simulated_node_cpu"]) if sim else
                       (t["node_send"], t["node_recv"], t["node_cpu"]))
    rate = node.cpu_adam_params_per_s or hw.cpu_adam_params_per_s
    return (f"memory node: state of {len(remote)} segments (master and {shape.optim_name} "
            f"slots there; gradient and compute copy in host RAM): {_short(remote)}; "
            f"{gib(p.remote_bytes)} of its usable {gib(p.budgets['remote'])}; link "
            f"{node.net_Bps / 1e9:.2f} GB/s each way; per step sent "
            f"{gib(p.moved_bytes.get('net_send', 0))} (gradients, busy {send:.2f} s), received "
            f"{gib(p.moved_bytes.get('net_recv', 0))} (compute copies, busy {recv:.2f} s); "
            f"its update {cpu:.2f} s at {rate / 1e9:.1f} G params/s"
            + (" (simulated)" if sim else ""))


def _short(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names) if len(names) <= 6 else ", ".join(names[:6]) + f", ... ({len(names)})"


def flags(p: Plan) -> list[str]:
    out = ["--offload-policy", "auto", "--microbatch-order", p.order]
    if not p.keep_resident_activations:
        out += ["--grad-checkpointing", "full"]
    if p.boundary_on_host:
        out += ["--boundary-activations", "host"]
    if any(q.remote for q in p.placements):  # the node this plan was made for
        out += ["--memory-node", "ADDRESS:PORT", "--memory-node-token-file", "FILE"]
    return out


def ledger_prediction(p: Plan) -> dict[str, int]:
    return {
        "predicted_device_peak_bytes": p.device_peak_bytes,
        "predicted_host_peak_bytes": p.host_peak_bytes,
        "predicted_disk_bytes": p.disk_bytes,
    }


def _speculation_line(p: Plan, shape: ModelShape, train: TrainShape) -> str | None:
    """What the plan chose for speculative disk-tier updates, and the simulated step of the
    variant it did not take (None where it did not try them)."""
    t = p.times_s
    spare = sum(spare_disk_bytes(shape, train, p.placements).values())
    if p.speculative:
        other = t.get("simulated_step_plain")
        return ("speculative updates: on, each disk-tier update issued at its gradient's final "
                f"landing into a second set of files ({gib(spare)} on disk), kept where the "
                "clipping coefficient is 1, its gradient taken from host RAM as it lands (at "
                f"most {p.held_gradients} held at once)" + (
                    "" if other is None else f" (simulated step {other:.2f} s without)"))
    if "simulated_step_speculative" in t:
        return (f"speculative updates: off (with them, {gib(spare)} more on disk, the "
                f"simulated step would be {t['simulated_step_speculative']:.2f} s)")
    return None
