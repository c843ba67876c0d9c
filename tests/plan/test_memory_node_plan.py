"""A memory node in the plan (issue T): the time model's network lanes and the node's CPU, the
replay's remote update (4n bytes of gradient up, the compute copy down, per remote segment per
step), the search's remote tier between host RAM and disk, and the plan's words for it."""

import dataclasses

import pytest

from tierlm.cli import main
from tierlm.config import OptimConfig
from tierlm.memory.device import TimingDevice
from tierlm.memory.hardware import PROFILES, GiB, MemoryNodeProfile
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.simulator import NET_RECV, NET_SEND, NODE_CPU
from tierlm.memory.tiers import Link, Tier
from tierlm.models import preset_config
from tierlm.optim import build_flat_optimizer
from tierlm.plan.describe import describe
from tierlm.plan.evaluate import NODE_STAGING_BYTES
from tierlm.plan.replay import ReplayConfig, simulate_step
from tierlm.plan.search import plan
from tierlm.runtime.byte_replay import _simulate
from tierlm.runtime.shapes import ModelShape, TrainShape

MiB = 2**20
NET_BPS = 2.5e9
NODE = MemoryNodeProfile(memory_bytes=10 * GiB, net_Bps=NET_BPS)
HW = PROFILES["rtx4090"].with_overrides(gpu_memory_bytes=2 * GiB)
SHAPE = ModelShape.from_config(preset_config("small", max_seq_len=64))
BUDGETS = {"device_budget": int(0.05 * GiB), "host_budget": int(0.25 * GiB)}


def _with(node: MemoryNodeProfile | None):
    return dataclasses.replace(HW, memory_node=node)


def test_timing_device_books_the_link_each_way_and_the_node_cpu_on_the_calling_thread():
    dev = TimingDevice(_with(dataclasses.replace(NODE, cpu_adam_params_per_s=1e9)))
    worker = dev.worker("update")
    begun = dev.begin_step()

    def remote_update():
        with dev.net(Link.NET_SEND, 4_000_000, "grad x"):
            pass
        with dev.node_work("update x", params=2e6):
            pass
        with dev.net(Link.NET_RECV, 1_000_000, "copy x"):
            pass

    worker.submit(remote_update).result()  # the training thread waits for the worker
    # then a receive of the training thread's own: it queues behind the worker's on that lane
    with dev.net(Link.NET_RECV, 500_000, "copy y"):
        pass
    lanes = dev.end_step(begun)
    send_s, node_s, recv_s = 4e6 / NET_BPS, 2e6 / 1e9, 1e6 / NET_BPS
    assert lanes["sim_net_send_s"] == pytest.approx(send_s)
    assert lanes["sim_node_cpu_s"] == pytest.approx(node_s)
    assert lanes["sim_net_recv_s"] == pytest.approx(recv_s + 5e5 / NET_BPS)
    # the worker waited for each in turn; the training thread waited for the worker, then for
    # its own transfer, queued on the receive lane behind the worker's
    assert worker.clock.t_s == pytest.approx(send_s + node_s + recv_s)
    assert lanes["sim_step_s"] == pytest.approx(send_s + node_s + recv_s + 5e5 / NET_BPS)
    ops = {op.name: op for op in dev.step_ops if op.lane in (NET_SEND, NET_RECV, NODE_CPU)}
    assert ops["grad x"].lane == NET_SEND and ops["copy x"].lane == NET_RECV
    assert ops["update x"].lane == NODE_CPU
    assert ops["update x"].start_s == pytest.approx(ops["grad x"].end_s)
    # full duplex: a send from another thread does not queue behind a receive
    with dev.timeline.thread("cpu other", dev.timeline.host.__class__("cpu other")):
        t0 = dev.timeline.host.t_s
        with dev.net(Link.NET_RECV, 1_000_000, "copy z"):
            pass
    with dev.net(Link.NET_SEND, 1_000_000, "grad z"):
        pass
    ops = {op.name: op for op in dev.timeline.ops if op.lane in (NET_SEND, NET_RECV)}
    assert ops["copy z"].start_s == pytest.approx(t0)
    assert ops["grad z"].start_s == pytest.approx(t0)


def test_without_a_node_the_time_model_refuses_network_work():
    dev = TimingDevice(HW)
    with pytest.raises(ValueError, match="no memory node"), dev.net(Link.NET_SEND, 8, "g"):
        pass
    with pytest.raises(ValueError, match="no memory node"), dev.node_work("u", params=1):
        pass
    assert "sim_net_send_s" not in dev.end_step(dev.begin_step())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replay_moves_4n_up_and_the_compute_copy_down_per_remote_segment_per_step(precision):
    n = len(SHAPE.names)
    remote = {2, 3, n - 2}
    placements = [SegmentPlacement(s in (1, n - 2), Tier.HOST, remote=s in remote)
                  for s in range(n)]
    placements[0] = SegmentPlacement(True, Tier.DEVICE)
    train = TrainShape(1, 16, 2, precision)
    timing = simulate_step(SHAPE, train, placements, "layer-outer", False, False,
                           ReplayConfig(hw=_with(NODE)))
    copy = {s: 4 * SHAPE.numels[s] if precision == "fp32" else SHAPE.wire_bytes(s, precision)
            for s in remote}
    if precision == "bf16":
        assert all(2 * SHAPE.numels[s] <= copy[s] < 4 * SHAPE.numels[s] for s in remote)
    for ops in timing.step_ops:  # every step, the first and the steady one
        net = [op for op in ops if op.lane in (NET_SEND, NET_RECV)]
        sent = {op.name: op.args["bytes"] for op in net if op.lane == NET_SEND}
        received = {op.name: op.args["bytes"] for op in net if op.lane == NET_RECV}
        assert sent == {f"grad {SHAPE.names[s]}": 4 * SHAPE.numels[s] for s in remote}
        assert received == {f"copy {SHAPE.names[s]}": copy[s] for s in remote}
    cpu_cost = build_flat_optimizer(OptimConfig()).cpu_cost
    busy = timing.lane_busy_s
    assert busy[NET_SEND] == pytest.approx(sum(4 * SHAPE.numels[s] for s in remote) / NET_BPS)
    assert busy[NET_RECV] == pytest.approx(sum(copy.values()) / NET_BPS)
    assert busy[NODE_CPU] == pytest.approx(
        sum(SHAPE.numels[s] for s in remote) * cpu_cost / HW.cpu_adam_params_per_s)
    # the byte replay counts the same payload per link, and the node's state by class
    ledger, _, _ = _simulate(SHAPE, train, placements, "layer-outer", False)
    assert ledger.total_moved_bytes[Link.NET_SEND] == sum(4 * SHAPE.numels[s] for s in remote)
    assert ledger.total_moved_bytes[Link.NET_RECV] == sum(copy.values())
    node_state = sum(8 * SHAPE.numels[s] + SHAPE.optim_state_bytes[s]
                     + (0 if precision == "fp32" else copy[s]) for s in remote)
    assert ledger.tier_bytes(Tier.REMOTE) == node_state


@pytest.fixture(scope="module")
def plans():
    train = TrainShape(1, 64, 2, "fp32")
    # a node that holds every segment, one that holds the first two spilled (the head and the
    # last block: its receive staging and a little room besides), one smaller than its own
    # staging
    last = len(SHAPE.names) - 1
    two = int((NODE_STAGING_BYTES + SHAPE.state_bytes(last) + SHAPE.state_bytes(last - 1)
               + MiB) / 0.9)
    nodes = {"none": None, "big": NODE, "two": dataclasses.replace(NODE, memory_bytes=two),
             "tiny": dataclasses.replace(NODE, memory_bytes=NODE_STAGING_BYTES // 2),
             "slow": dataclasses.replace(NODE, net_Bps=1e6)}
    return train, {k: plan(SHAPE, train, _with(v), **BUDGETS) for k, v in nodes.items()}


def _tiers(p) -> list[str]:
    return ["remote" if q.remote else q.state_tier.value for q in p.placements]


def test_search_puts_state_on_the_node_before_the_disk(plans):
    train, p = plans
    base, big = p["none"], p["big"]
    assert base.fits and big.fits
    spilled = {s for s, t in enumerate(_tiers(base)) if t == "disk"}
    assert spilled and not base.remote_bytes
    # every segment the plan without a node spills goes to the node; none to disk
    assert "disk" not in _tiers(big)
    remote = {s for s, t in enumerate(_tiers(big)) if t == "remote"}
    assert spilled <= remote
    assert big.disk_bytes == 0 and big.moved_bytes["disk_write"] == 0
    assert big.remote_bytes == NODE_STAGING_BYTES + sum(
        8 * SHAPE.numels[s] + SHAPE.optim_state_bytes[s] for s in remote)
    assert big.remote_bytes <= big.budgets["remote"]
    # the plan's network bytes: every remote segment's gradient up, its fp32 weights down
    up = sum(4 * SHAPE.numels[s] for s in remote)
    assert big.moved_bytes["net_send"] == big.moved_bytes["net_recv"] == up
    assert big.times_s["simulated_net_send"] == pytest.approx(up / NET_BPS)
    assert big.times_s["node_send"] == pytest.approx(up / NET_BPS)


def test_search_fills_the_node_to_its_memory_then_the_disk(plans):
    _, p = plans
    two = p["two"]
    assert two.fits
    tiers = _tiers(two)
    assert tiers[-2:] == ["remote", "remote"] and tiers.count("remote") == 2
    assert "disk" in tiers
    assert two.remote_bytes <= two.budgets["remote"]
    assert two.budgets["remote"] - two.remote_bytes < min(
        SHAPE.state_bytes(s) for s, t in enumerate(tiers) if t == "disk")  # the node is full
    # a node smaller than its own receive staging holds nothing: the plan without a node
    tiny = p["tiny"]
    assert _tiers(tiny) == _tiers(p["none"]) and tiny.remote_bytes == 0
    assert tiny.moved_bytes == p["none"].moved_bytes


def test_a_node_behind_a_slow_link_never_makes_the_plan_slower(plans):
    _, p = plans
    slow, base = p["slow"], p["none"]
    # at 1 MB/s the node's updates would take seconds where the disk's take milliseconds: the
    # plan is the one without the node
    assert _tiers(slow) == _tiers(base) and slow.remote_bytes == 0
    assert slow.step_s == pytest.approx(base.step_s)
    assert "remote" in slow.budgets  # the node is still there, unused


def test_plan_output_names_the_node_its_bytes_and_the_network(plans):
    train, p = plans
    text = describe(p["big"], SHAPE, train, _with(NODE))
    remote = [SHAPE.names[s] for s, t in enumerate(_tiers(p["big"])) if t == "remote"]
    line = next(x for x in text.splitlines() if x.startswith("memory node:"))
    assert f"state of {len(remote)} segments" in line and remote[0] in line
    assert "of its usable 9.00 GiB" in line and "link 2.50 GB/s each way" in line
    assert "per step sent" in line and "(gradients, busy" in line
    assert "received" in line and "(compute copies, busy" in line
    assert "(simulated)" in line
    assert any(x.startswith("  memory node ") for x in text.splitlines())
    assert "net send" in text and "node cpu" in text  # the simulated lanes' busy time
    assert "--memory-node ADDRESS:PORT" in text
    # without a node: none of it
    plain = describe(p["none"], SHAPE, train, HW)
    assert "memory node" not in plain and "net send" not in plain


@pytest.mark.parametrize("argv, err", [
    (["--memory-node-memory", "128GiB", "--net-bandwidth", "fast"],
     "--net-bandwidth: 'fast' is not a link rate; write e.g. 25Gbit"),
    (["--memory-node-memory", "128GiB", "--net-bandwidth", "25"],
     "--net-bandwidth: '25' is not a link rate"),
    (["--memory-node-memory", "128GiB"], "give --net-bandwidth"),
    (["--net-bandwidth", "25Gbit"], "--net-bandwidth is the link to a memory node: give the "
     "node's --memory-node-memory"),
])
def test_bad_node_flags_are_one_line_errors_naming_the_flag(argv, err, capsys):
    rc = main(["plan", "--model-size", "tiny", "--hardware", "rtx4090", *argv])
    assert rc == 2
    out = capsys.readouterr().err
    assert out.startswith("tierlm: error: ") and err in out and "Traceback" not in out


def test_net_bandwidth_units():
    from tierlm.config.units import parse_bandwidth

    assert parse_bandwidth("25Gbit") == parse_bandwidth("25Gb/s") == 25e9 / 8
    assert parse_bandwidth("10GbE") == 10e9 / 8
    assert parse_bandwidth("3GB/s") == 3e9 and parse_bandwidth("1GiB/s") == 2**30


def test_train_refuses_the_plan_only_node_flags(capsys):
    rc = main(["train", "--model-size", "tiny", "--max-steps", "1", "--memory-node-memory",
               "128GiB", "--net-bandwidth", "25Gbit"])
    assert rc == 2
    assert "--memory-node-memory on a training run describes its memory node: name the node " \
        "with --memory-node" in capsys.readouterr().err


def test_predicted_timeline_draws_the_remote_updates_on_the_node_lanes(plans):
    from tierlm.plan.timeline import predicted_timeline

    train, p = plans
    events = predicted_timeline(SHAPE, train, _with(NODE), p["big"])
    remote = [SHAPE.names[s] for s, t in enumerate(_tiers(p["big"])) if t == "remote"]
    by_lane: dict[str, list] = {}
    for e in events:
        by_lane.setdefault(e.lane, []).append(e)
    assert sorted(e.name for e in by_lane["net send"]) == sorted(f"grad {n}" for n in remote)
    assert sorted(e.name for e in by_lane["net recv"]) == sorted(f"copy {n}" for n in remote)
    assert len(by_lane["node cpu"]) == len(remote)
    assert sum(e.args["bytes"] for e in by_lane["net send"]) == pytest.approx(
        p["big"].moved_bytes["net_send"], rel=1e-6)
    assert not any(e.name.startswith("state block") for e in by_lane.get("disk read", []))
