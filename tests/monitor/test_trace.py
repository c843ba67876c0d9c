"""--monitor.trace_step: a timeline of one step in the Chrome trace event format, measured and
predicted, whose lanes never overlap and whose compute lane is the step's compute_s."""

import json
from collections import Counter, defaultdict

import pytest

from tests.monitor_helpers import quiet, tiny_corpus, tiny_run_cfg
from tierlm.cli import main
from tierlm.config import ConfigError, validate
from tierlm.memory.disk import DiskTier
from tierlm.memory.store import Store
from tierlm.monitor.metrics import read_metrics
from tierlm.monitor.report import load_run, trace_figures
from tierlm.runtime.writeback import deferred_copies
from tierlm.trace import MEASURED_PID, PREDICTED_PID, NoTracer, TraceEvent, chrome_trace
from tierlm.train import Trainer

TRACE_STEP = 2
M = 2  # micro-batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def traced(corpus, tmp_path_factory):
    """A disk-tier run of `tiny` with 2 micro-batches, step 2 traced; with the number of copies
    and disk requests the store made while the tracer was armed."""
    out = tmp_path_factory.mktemp("traced")
    cfg = tiny_run_cfg(out, corpus, policy="disk", max_steps=3, grad_accum_steps=M)
    cfg.monitor.trace_step = TRACE_STEP
    validate(cfg)
    t = Trainer(cfg, log=quiet)
    tracer = t.stepper.tracer
    counts: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        _count_while_armed(mp, Store, "_copy", tracer, counts, "copy")
        _count_while_armed(mp, DiskTier, "_submit", tracer, counts, "disk")
        t.train()
    t.stepper.close()
    return out, t.stepper, counts


def _count_while_armed(monkeypatch, cls, method, tracer, counts, key):
    orig = getattr(cls, method)

    def spy(self, *args, **kw):
        if tracer.armed:
            counts[key] += 1
        return orig(self, *args, **kw)

    monkeypatch.setattr(cls, method, spy)


def _rows(trace):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    rows = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            rows[(e["pid"], e["tid"])].append(e)
    return names, rows


def test_disk_run_traces_every_action_and_transfer(traced):
    run_dir, engine, counts = traced
    trace = json.loads((run_dir / "trace.json").read_text(encoding="utf-8"))
    # the Chrome trace event format: complete events and the metadata naming processes/rows
    assert set(trace) >= {"traceEvents"}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
            assert e["ts"] >= 0 and e["dur"] >= 0
    names, rows = _rows(trace)
    assert set(rows) <= set(names)  # every row is named
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "measured", "predicted"}

    # events in one row never overlap
    for evs in rows.values():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)

    measured = [e for evs in rows.values() for e in evs if e["pid"] == MEASURED_PID]
    by_lane = defaultdict(list)
    for e in sorted(measured, key=lambda e: e["ts"]):
        by_lane[e["args"]["lane"]].append(e)

    # one compute event per scheduled action, in schedule order
    seg_names = [st.seg.name for st in engine.states]
    schedule = [a.label(seg_names) for a in engine.schedule(M)]
    actions = [e["name"] for e in by_lane["step"] if e["cat"] == "action"]
    assert actions == schedule
    # the predicted step is the replay's: one compute region per action and micro-batch
    kinds = {"fwd": "forward", "bwd": "backward", "head": "head"}
    predicted = Counter(e["name"] for evs in rows.values() for e in evs
                        if e["pid"] == PREDICTED_PID and e["args"]["lane"] == "compute"
                        and e["name"].split(" ")[0] in kinds.values())
    assert predicted == Counter(f"{kinds[a.kind]} {seg_names[a.seg]}"
                                for a in engine.schedule(M) for _ in a.mbs)

    # one event per copy and per disk request made while armed; bytes as the ledger counted
    rec = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step") == TRACE_STEP
               and "loss" in r)
    assert len(by_lane["H2D"]) + len(by_lane["D2H"]) == counts["copy"] > 0
    assert len(by_lane["disk read"]) + len(by_lane["disk write"]) == counts["disk"] > 0
    for lane, key in (("H2D", "h2d_bytes"), ("D2H", "d2h_bytes")):
        assert sum(e["args"]["bytes"] for e in by_lane[lane]) == rec[key]
    # the step's own updates, one per segment (all on disk), in forward order, come last
    updates = [e["name"] for e in by_lane["cpu update"]]
    assert updates[-len(seg_names):] == [f"update {n}" for n in seg_names]
    # their deferred write-back: the writer's requests on the disk write lane, each started
    # within or after its segment's update (the update's span closes after it hands them over)
    for st, update in zip(engine.states, by_lane["cpu update"][-len(seg_names):], strict=True):
        files = {st.file(c)
                 for c in deferred_copies(st.state_copies, st.compute_format is not None)}
        assert files
        written = {e["name"] for e in by_lane["disk write"] if e["ts"] >= update["ts"]}
        assert files <= written, (files, written)

    # the compute lane is what the step's compute clock measured: compute_s; every compute
    # region lies inside one of the step's actions
    assert by_lane["compute"] and all(e["cat"] == "compute" for e in by_lane["compute"])
    spans = [(a["ts"], a["ts"] + a["dur"]) for a in by_lane["step"] if a["cat"] == "action"]
    assert all(any(t0 - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= t1 + 1e-3 for t0, t1 in spans)
               for e in by_lane["compute"])
    # the same clock readings (tierlm.runtime.clock): equal but for the trace's rounding of
    # each end to the nanosecond
    compute_s = sum(e["dur"] for e in by_lane["compute"]) / 1e6
    assert compute_s == pytest.approx(rec["compute_s"], abs=1e-9 * (len(by_lane["compute"]) + 1))
    assert trace["otherData"]["measured_s"]["compute_s"] == rec["compute_s"]
    placement = trace["otherData"]["placement"]
    assert [p["segment"] for p in placement] == seg_names
    assert all(p["state_tier"] == "disk" and p["bytes"]["disk"]["master"] == 4 * p["numel"]
               for p in placement)


def test_rows_split_a_lane_only_where_events_overlap():
    ev = [TraceEvent("disk read", f"r{i}", "disk", s, e) for i, (s, e) in
          enumerate([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (1.5, 2.5)])]
    trace = chrome_trace(ev, origin_s=0.0)
    names, rows = _rows(trace)
    by_row = {names[k]: sorted(e["name"] for e in v) for k, v in rows.items()}
    assert by_row == {"disk read": ["r0", "r2"], "disk read 2": ["r1"], "disk read 3": ["r3"]}


def test_a_run_without_tracing_holds_the_null_tracer(corpus, tmp_path):
    t = Trainer(tiny_run_cfg(tmp_path, corpus, policy="disk", max_steps=1), log=quiet)
    assert isinstance(t.stepper.tracer, NoTracer) and isinstance(t.stepper.store.tracer, NoTracer)
    t.train()
    t.stepper.close()
    assert not (tmp_path / "trace.json").exists()


def test_trace_step_flag_is_checked(corpus, tmp_path):
    cfg = tiny_run_cfg(tmp_path, corpus, policy="disk", max_steps=3)
    cfg.monitor.trace_step = 4
    with pytest.raises(ConfigError, match="--monitor.trace_step 4 .*--max-steps 3"):
        validate(cfg)
    cfg = tiny_run_cfg(tmp_path, corpus, policy="none", max_steps=3)
    cfg.monitor.trace_step = 1
    with pytest.raises(ConfigError, match="--monitor.trace_step.*--offload-policy"):
        validate(cfg)


def test_report_draws_the_lanes_and_the_placement(traced, tmp_path):
    run_dir, engine, _ = traced
    run = load_run(run_dir)
    figs = trace_figures([run])
    assert set(figs) == {"trace", "placement"}
    drawn = {c.get_gid() for ax in figs["trace"].axes for c in ax.collections}
    names, rows = _rows(run.trace)
    process = {MEASURED_PID: "measured", PREDICTED_PID: "predicted"}
    assert drawn == {f"trace/{process[pid]}/{names[(pid, tid)]}" for pid, tid in rows}
    bars = {c.get_label() for ax in figs["placement"].axes for c in ax.containers}
    assert bars == {"disk/master", "disk/optim_state", "disk/grad"}
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "![trace](trace.png)" in md and "![placement](placement.png)" in md
    assert (tmp_path / "trace.png").stat().st_size > 0


# -- the predicted timeline: the replay's operations (the plan's simulated step), the update and
# its write-back included --

def _predicted(hw_name, precision, writeback):
    """All-disk `tiny`, 2 micro-batches: (shape, train, hw, plan, predicted events), the plan's
    simulated times in its `times_s` (as `tierlm plan` gives them)."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.memory.tiers import Tier
    from tierlm.models import preset_config
    from tierlm.plan.evaluate import evaluate, simulated_times
    from tierlm.plan.result import usable_budgets
    from tierlm.plan.timeline import predicted_timeline
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("tiny", max_seq_len=32))
    train = TrainShape(2, 32, M, precision)
    hw = PROFILES[hw_name]
    placements = [SegmentPlacement(False, Tier.DISK)] * len(shape.names)
    plan = evaluate(shape, train, hw, placements, "microbatch-outer", False, usable_budgets(hw),
                    writeback=writeback)
    plan.times_s.update(simulated_times(shape, train, hw, plan))
    return shape, train, hw, plan, predicted_timeline(shape, train, hw, plan)


def _lanes(events):
    lanes = defaultdict(list)
    for e in sorted(events, key=lambda e: (e.start_s, e.end_s)):
        lanes[e.lane].append(e)
    return lanes


def _never_overlap(events):
    for a, b in zip(events, events[1:], strict=False):
        assert a.end_s <= b.start_s + 1e-12, (a, b)


def _update_disk(events, step, name, link):
    """The disk requests of `name`'s update (after the step's sweep: the update runs behind
    the next step's forward) over `link`."""
    return [e for e in events if e.lane == "disk" and e.start_s >= step.end_s - 1e-12
            and e.name.startswith(f"{name}/") and e.args["link"] == link]


@pytest.mark.parametrize("hw_name", ["cpu", "rtx4090"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("segments", [1, 4])
def test_predicted_write_back_follows_each_update_on_the_drive(hw_name, precision, segments):
    from tierlm.plan.timing import writeback_bytes
    from tierlm.runtime.byte_replay import _compute_copies
    from tierlm.runtime.state import generation_file
    from tierlm.runtime.writeback import WriteBack

    shape, train, hw, plan, events = _predicted(hw_name, precision, WriteBack(segments=segments))
    copies = _compute_copies(shape, precision, plan.placements)
    deferred = writeback_bytes(shape, plan.placements, copies, plan.writeback)
    assert deferred
    lanes = _lanes(events)
    (step,) = lanes["step"]
    updates = {e.name.removeprefix("update "): e for e in lanes["cpu update"]}
    assert list(updates) == shape.names  # one per segment, in forward order
    # each deferred segment's write-back: its deferred copies' files on the drive, after its
    # update, with the bytes the planner counts, in update order (first in, first out)
    backs = []
    for s in sorted(deferred):
        name = shape.names[s]
        files = {generation_file(name, c, 0)
                 for c in deferred_copies(("master", "exp_avg", "exp_avg_sq"),
                                          copies[s] is not None)}
        writes = [e for e in _update_disk(events, step, name, "disk_write") if e.name in files]
        assert {e.name for e in writes} == files
        assert min(e.start_s for e in writes) >= updates[name].end_s - 1e-12
        assert sum(e.args["bytes"] for e in writes) == deferred[s]
        backs.append(writes)
    for a, b in zip(backs, backs[1:], strict=False):
        assert max(e.end_s for e in a) <= min(e.start_s for e in b) + 1e-12
    # at most `segments` pending: a deferred segment's update reads its state only once the
    # write-back `segments` before it has landed
    for k, s in enumerate(sorted(deferred)):
        if k >= segments:
            reads = _update_disk(events, step, shape.names[s], "disk_read")
            assert min(e.start_s for e in reads) >= max(e.end_s for e in backs[k - segments]) \
                - 1e-12
    # the step is the plan's simulated one
    assert step.start_s == 0.0
    assert step.end_s == pytest.approx(plan.times_s["simulated_step"], rel=1e-12)
    # no lane overlaps itself (the drive's reads and writes share it), nor any row drawn
    for evs in lanes.values():
        _never_overlap(evs)
    names, rows = _rows(chrome_trace([], 0.0, events))
    for evs in rows.values():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)


@pytest.mark.parametrize("hw_name", ["cpu", "rtx4090"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_predicted_update_with_the_write_back_inside(hw_name, precision):
    """Without a deferred write-back the update is drawn per segment, in forward order, as its
    disk reads (state and gradient), its CPU update and the write of its whole state (and its
    compute copy), one after another, nothing of it on the write-back's thread."""
    from tierlm.runtime.byte_replay import _compute_copies

    shape, train, hw, plan, events = _predicted(hw_name, precision, None)
    copies = _compute_copies(shape, precision, plan.placements)
    assert (precision == "bf16") == any(copies[1:-1])
    lanes = _lanes(events)
    (step,) = lanes["step"]
    assert "cpu writeback" not in lanes and "cpu writeback wait" not in lanes
    updates = {e.name.removeprefix("update "): e for e in lanes["cpu update"]}
    assert list(updates) == shape.names
    t = step.end_s - 1e-12
    for s, name in enumerate(shape.names):
        read, written = shape.update_disk_bytes(s, copies[s])
        reads = _update_disk(events, step, name, "disk_read")
        writes = _update_disk(events, step, name, "disk_write")
        assert sum(e.args["bytes"] for e in reads) == read
        assert sum(e.args["bytes"] for e in writes) == written
        update = updates[name]
        assert t <= min(e.start_s for e in reads)
        assert max(e.end_s for e in reads) <= update.start_s + 1e-12
        assert update.end_s <= min(e.start_s for e in writes) + 1e-12
        t = max(e.end_s for e in writes) - 1e-12
        assert update.end_s - update.start_s == pytest.approx(
            shape.numels[s] / hw.cpu_adam_params_per_s)
    for evs in lanes.values():
        _never_overlap(evs)
    assert step.end_s == pytest.approx(plan.times_s["simulated_step"], rel=1e-12)


def test_predicted_trace_is_the_step_the_plan_printed():
    """The planner's own plan (`tierlm plan`: its prediction is the simulated step) of a tiered
    `tiny`: the predicted trace's step event lasts the printed step, `simulated_step`, and its
    compute lane is the simulated compute."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.tiers import Tier
    from tierlm.models import preset_config
    from tierlm.plan.search import plan
    from tierlm.plan.timeline import predicted_timeline
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("tiny", max_seq_len=32))
    train = TrainShape(2, 32, M, "bf16")
    hw = PROFILES["rtx4090"]
    p = plan(shape, train, hw, device_budget=12 * 2**20, host_budget=10 * 2**20)
    assert p.fits and Tier.DISK in {pl.state_tier for pl in p.placements}
    assert not all(pl.resident for pl in p.placements)  # some weights streamed
    lanes = _lanes(predicted_timeline(shape, train, hw, p))
    (step,) = lanes["step"]
    assert (step.start_s, step.end_s) == (0.0, p.times_s["simulated_step"])
    assert step.end_s == p.step_s  # what `tierlm plan` printed
    assert sum(e.end_s - e.start_s for e in lanes["compute"]) == pytest.approx(
        p.times_s["simulated_compute"], rel=1e-9)


def test_on_a_simulated_gpu_the_predicted_lanes_are_the_measured_ones(tmp_path):
    """`--device sim:rtx4090` on the disk tier, step 2 traced: the engine's step on the
    simulated GPU and the planner's replay of it give the same events, lane, name, start and
    duration (to the trace's nanosecond), the step's own included."""
    from tierlm.config import from_dict

    cfg = from_dict({
        "model": {"size": "tiny"}, "data": {"seq_len": 32, "vocab_size": 512},
        "memory": {"offload_policy": "disk"},
        "train": {"max_steps": 2, "batch_size": 2, "grad_accum_steps": M, "eval_every": 0,
                  "eval_batches": 1, "save_final": False, "sample_tokens": 0},
        "run": {"out": str(tmp_path), "device": "sim:rtx4090", "seed": 3},
        "monitor": {"trace_step": 2},
    })
    t = Trainer(cfg, log=quiet)
    t.train()
    t.stepper.close()
    trace = json.loads((tmp_path / "trace.json").read_text(encoding="utf-8"))

    def events(pid):
        return sorted((e["args"]["lane"], e["name"], e["ts"], e["dur"])
                      for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid)

    measured, predicted = events(MEASURED_PID), events(PREDICTED_PID)
    assert {lane for lane, *_ in measured} >= {"step", "compute", "H2D", "D2H", "disk",
                                               "cpu update"}
    assert [e[:2] for e in predicted] == [e[:2] for e in measured]
    for p, m in zip(predicted, measured, strict=True):
        assert p[2:] == pytest.approx(m[2:], abs=2e-3), (p, m)  # µs: the ns rounding
    # a placement the user chose (--offload-policy disk): the step the run printed
    # (`plan_step_s`) is the simulated one too, not the search's closed-form estimate
    (step,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == PREDICTED_PID
               and e["args"]["lane"] == "step"]
    assert "not_simulated" not in step["args"]
    assert step["args"]["plan_step_s"] * 1e6 == pytest.approx(step["dur"], abs=2e-3)
