"""The memory node as a tier of the engine and the trainer (tierlm.runtime's remote segments,
tierlm.train.node): two processes on loopback. Remote segments beside device, host and disk
ones train bit for bit as the same segments on the host tier; each step moves exactly 4n bytes
of gradient to the node and the compute copy back per remote segment; a node killed mid-run
stops the trainer with an error naming it and a verified checkpoint, from which a new node
resumes to the uninterrupted run's losses."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.node.test_memory_node import TOKEN, Node, _env, _token_file
from tests.runtime_helpers import (
    InfGrad,
    batches,
    bf16_autocast,
    bf16_model,
    new_engine,
    tiny_model,
)
from tierlm.checkpoint.format import verify_checkpoint
from tierlm.cli import main
from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Link, Tier
from tierlm.models import build_model, preset_config
from tierlm.node.protocol import SegmentSpec
from tierlm.node.server import NodeOptions, Session
from tierlm.precision.linear import Fp32Linear, PrecisionLinear
from tierlm.runtime.placement import place
from tierlm.runtime.state import as_tensor, step_net_bytes
from tierlm.train.node import MemoryNodeError, check_node_capacity

STEPS, M, CLIP, LR = 3, 2, 0.05, 1e-2
HOST = SegmentPlacement(False, Tier.HOST)
# embed on the device, block.0 resident host state, block.1 on disk, block.2 and head streamed
# from host state; the remote run moves block.0 (resident), block.2 and head to the node
LOCAL = [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(True, Tier.HOST),
         SegmentPlacement(False, Tier.DISK), HOST, HOST]
REMOTE = [LOCAL[0], SegmentPlacement(True, Tier.HOST, remote=True), LOCAL[2],
          SegmentPlacement(False, Tier.HOST, remote=True),
          SegmentPlacement(False, Tier.HOST, remote=True)]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"))
    yield n
    n.stop()


def _train(base, placements, order: str, precision: str, tmp_path: Path, client=None,
           skip: int | None = None):
    """STEPS steps of `base` under `placements`: (losses, grad norms, weights, optimizer state,
    the NET_SEND/NET_RECV bytes of each step, the bytes a step is to move by
    `step_net_bytes`, and the same counted here by hand).
    `skip`: the step whose gradient is made infinite (skipped)."""
    model = copy.deepcopy(base)
    hook = InfGrad()
    model.model.layers[1].mlp.register_forward_hook(hook)
    kw = {}
    if precision == "bf16":
        model = bf16_model(model)
        kw["autocast"] = bf16_autocast
    eng = new_engine(model, tmp_path / f"off-{client is not None}", placements=placements,
                     microbatch_order=order, micro_batches=M, grad_clip=CLIP, node=client, **kw)
    assert eng.report.placements == placements
    losses, norms, moved = [], [], []
    sent0 = None if client is None else client.bytes_sent
    for i, b in enumerate(batches(STEPS, M, seed=3)):
        hook.armed = i == skip
        before = dict(eng.ledger.total_moved_bytes)
        rec = eng.step(b, LR)
        # the step's own counters, as the trainer's metrics read them: the bytes its update
        # moves are counted as it is submitted, though it runs behind the next step's start
        step_moved = tuple(eng.ledger.moved_bytes[link] for link in (Link.NET_SEND,
                                                                     Link.NET_RECV))
        eng.synchronize()  # the step's update has run: nothing more counted
        assert rec["skipped"] == (i == skip)
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        moved.append(tuple(eng.ledger.total_moved_bytes[link] - before.get(link, 0)
                           for link in (Link.NET_SEND, Link.NET_RECV)))
        assert moved[-1] == step_moved
    # the helper the planner's network lane is to equal (runtime.state.step_net_bytes)
    expect = step_net_bytes(eng.report.placements, [st.numel for st in eng.states],
                            [None if st.compute_format is None else st.compute_format.nbytes
                             for st in eng.states])
    # counted independently of the helper: 4 bytes a parameter up, the copy's bytes down
    by_hand = (sum(4 * st.numel for st in eng.states if st.placement.remote),
               sum(st.wire.numel() if st.wire is not None else 4 * st.numel
                   for st in eng.states if st.placement.remote))
    weights, state = eng.weights(), eng.optimizer_state()
    # what a checkpoint writes, one segment at a time (a remote one fetched from the node)
    shards = {name: {k: as_tensor(v).clone() for part in (w, o) for k, v in part.items()}
              for name, w, o in eng.state_shards()}
    state["shards"] = shards
    eng.close()
    if client is not None:  # headers ride beside the payloads: the client's own count
        assert client.bytes_sent - sent0 > (STEPS - (skip is not None)) * by_hand[0]
    return losses, norms, weights, state, moved, expect, by_hand


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_remote_segments_train_as_the_host_tier(node, order, precision, tmp_path):
    """Same model, batches and placements but three segments' state on the node: losses,
    gradient norms (clipping active), weights and optimizer state equal bit for bit, and each
    step moves the remote segments' 4n up and c down, no more. Under bf16 the second step is
    skipped (an infinite gradient): it sends nothing and leaves nothing behind on either side
    (the fp32 runs update every step: a skip would wipe a gradient the update left behind)."""
    base = tiny_model("llama_tied_gqa", layers=3)
    skip = 1 if precision == "bf16" else None
    local = _train(base, LOCAL, order, precision, tmp_path, skip=skip)
    with node.connect("socket") as client:
        remote = _train(base, REMOTE, order, precision, tmp_path, client, skip=skip)
    done = [i for i in range(STEPS) if i != skip]
    assert remote[0] == local[0]
    assert [remote[1][i] for i in done] == [local[1][i] for i in done]
    assert all(local[1][i] > CLIP for i in done)
    got_shards, ref_shards = remote[3].pop("shards"), local[3].pop("shards")
    assert got_shards.keys() == ref_shards.keys()
    pairs = [(local[2], remote[2]), (local[3], remote[3])] + [
        (ref_shards[name], got_shards[name]) for name in ref_shards]
    for ref, got in pairs:
        assert ref.keys() == got.keys()
        for k, v in ref.items():
            assert torch.equal(got[k], v), k
    # the bytes: the local run moves none over the network; each remote step exactly these
    assert local[4] == [(0, 0)] * STEPS
    per_step = remote[5]
    assert per_step == remote[6] and per_step[0] > 0
    if precision == "bf16":  # the copies come back in 2 bytes a weight where layers are bf16
        assert per_step[1] < per_step[0]
    assert remote[4] == [(0, 0) if i == skip else per_step for i in range(STEPS)]


@pytest.mark.parametrize(("preset", "order"), [("tiny", "microbatch-outer"),
                                                ("small", "layer-outer")])
def test_the_presets_train_as_on_the_host_tier(node, preset, order, tmp_path):
    """The `tiny` (2 blocks) and `small` (8 blocks) presets with bf16 copies: embed on the
    device, block.0 resident, block.1 on disk, the rest streamed from host state; the remote
    run moves block.0 and the streamed segments (but block.2 of `small`) to the node. As on
    the host tier, bit for bit."""
    base = build_model(preset_config(preset, vocab_size=512, max_seq_len=16), seed=0)
    n = base.config.num_hidden_layers + 2
    local = [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(True, Tier.HOST),
             SegmentPlacement(False, Tier.DISK)] + [HOST] * (n - 3)
    # block.0 (resident), and every segment after the disk one but one host-tier block
    placed = [local[0], SegmentPlacement(True, Tier.HOST, remote=True), local[2]] + [
        SegmentPlacement(False, Tier.HOST, remote=True)] * (n - 3)
    if n > 5:
        placed[3] = HOST
    ref = _train(base, local, order, "bf16", tmp_path)
    with node.connect("socket") as client:
        got = _train(base, placed, order, "bf16", tmp_path, client)
    assert got[0] == ref[0] and got[1] == ref[1]
    for k, v in ref[2].items():
        assert torch.equal(got[2][k], v), k
    for k, v in ref[3].items():
        if k != "shards":
            assert torch.equal(got[3][k], v), k
    assert got[4] == [got[5]] * STEPS and got[5] == got[6] and got[5][0] > 0


def test_a_layer_switched_to_another_dtype_reshapes_the_remote_copy(node, tmp_path):
    """A layer of a remote segment that changes its compute dtype between steps (as the fp8
    watch switches a layer to bf16): the copy the node sends back takes the new format from the
    next update on, as the host tier's does; the runs stay equal bit for bit."""
    base = tiny_model("llama_tied_gqa", layers=3)

    def run(placements, client=None):
        model = bf16_model(copy.deepcopy(base))
        eng = new_engine(model, tmp_path / f"off-{client is not None}", placements=placements,
                         micro_batches=M, grad_clip=CLIP, node=client, autocast=bf16_autocast)
        losses = []
        for i, b in enumerate(batches(4, M, seed=3)):
            if i == 2:  # block.2's first layer, a remote segment's in the remote run
                layer = next(m for n, m in model.named_modules()
                             if isinstance(m, PrecisionLinear) and ".layers.2." in n)
                layer.compute = Fp32Linear()
            losses.append(eng.step(b, LR)["loss"])
            eng.synchronize()
        kinds = eng.states[3].compute_format.kinds
        weights = eng.weights()
        eng.close()
        return losses, weights, kinds

    ref = run(LOCAL)
    with node.connect("socket") as client:
        got = run(REMOTE, client)
    assert got[2] == ref[2] and got[2][0] == "fp32"  # the switched layer's copy: fp32 now
    assert got[0] == ref[0]
    for k, v in ref[1].items():
        assert torch.equal(got[1][k], v), k


# -- placement and checks ----

NAMES = ["embed", "block.0", "block.1", "block.2", "head"]
NUMELS = [1000, 2000, 2000, 2000, 1000]


@pytest.mark.parametrize("policy", ["host", "disk", "tiered"])
def test_remote_moves_the_matching_segments_to_the_node(policy):
    budget = {"device_budget_bytes": 10**9} if policy == "tiered" else {}
    plain = place(NAMES, NUMELS, policy=policy, resident="block.0", **budget).placements
    report = place(NAMES, NUMELS, policy=policy, resident="block.0", remote="block.[01]",
                   slot_bytes=[8 * n for n in NUMELS], **budget)
    got = report.placements
    for i, name in enumerate(NAMES):
        if name in ("block.0", "block.1"):  # resident where the policy made it resident
            assert got[i] == SegmentPlacement(plain[i].resident, Tier.HOST, remote=True)
        else:
            assert got[i] == plain[i]
    # on the node: fp32 master and gradient, AdamW's two moments
    assert report.remote_bytes == 16 * (NUMELS[1] + NUMELS[2])


def test_offload_policy_remote_keeps_only_resident_segments_local():
    got = place(NAMES, NUMELS, policy="remote", resident="embed|head").placements
    remote = SegmentPlacement(False, Tier.HOST, remote=True)
    assert got == [SegmentPlacement(True, Tier.DEVICE), remote, remote, remote,
                   SegmentPlacement(True, Tier.DEVICE)]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--offload-policy", "host", "--remote", "block.*"], "--memory-node ADDRESS:PORT"),
    (["--offload-policy", "remote"], "--memory-node ADDRESS:PORT"),
    (["--offload-policy", "host", "--remote", "block.*", "--memory-node", "10.0.0.2:29600"],
     "needs --memory-node-token-file"),
    (["--offload-policy", "host", "--memory-node", "10.0.0.2:29600",
      "--memory-node-token-file", "t"], "choose the segments with --remote"),
    (["--offload-policy", "auto", "--remote", "block.*", "--memory-node", "10.0.0.2:29600",
      "--memory-node-token-file", "t"], "the planner chooses the segments the node holds"),
    (["--memory-node", "10.0.0.2:29600", "--memory-node-token-file", "t"],
     "--memory-node with --offload-policy none"),
    (["--offload-policy", "host", "--remote", "block.*", "--memory-node", "10.0.0.2:29600",
      "--memory-node-token-file", "t", "--nproc", "2"], "not supported yet"),
    (["--offload-policy", "host", "--remote", "block.*", "--memory-node", "10.0.0.2:29600",
      "--memory-node-token-file", "t", "--finetune", "lora"], "not supported yet"),
])
def test_node_flags_are_checked(argv, needle, capsys):
    assert main(["train", "--model-size", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm: error:") and needle in err, err


def test_remote_state_the_node_cannot_hold_is_refused_naming_the_flags():
    report = place(NAMES, NUMELS, policy="remote", slot_bytes=[8 * n for n in NUMELS])
    node = SimpleNamespace(address="10.0.0.2:29600",
                           hello=SimpleNamespace(memory_bytes=report.remote_bytes - 1))
    with pytest.raises(MemoryNodeError, match=r"--memory, or put fewer segments on it with "
                                              r"--remote") as e:
        check_node_capacity(report, node)
    assert "10.0.0.2:29600" in str(e.value)
    node.hello.memory_bytes = report.remote_bytes
    check_node_capacity(report, node)


# -- the trainer, as `tierlm train` runs it ----

TRAIN = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data.vocab_size",
         "1024", "--eval-every", "0", "--train.sample_tokens", "0", "--optim.warmup_steps", "0",
         "--optim.min_lr_ratio", "1", "--offload-policy", "host", "--optim.grad_clip", "0.05"]


def _tierlm(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierlm", *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _with_node(node: Node, token_file: Path) -> list[str]:
    return ["--remote", "block.*", "--memory-node", node.address,
            "--memory-node-token-file", str(token_file), "--memory-node-timeout", "30"]


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    recs = [json.loads(line) for line in lines if line.endswith("}")]  # one being written: not
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "step" in r}


def _wait(what: str, ready, *procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120  # a bound on a wait, not a timing assertion
    while not ready():
        for p in procs:
            assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _checkpoints(run: Path) -> list[Path]:
    ckpts = run / "checkpoints"
    return sorted(p for p in ckpts.iterdir() if p.name.startswith("step_")) if (
        ckpts.is_dir()) else []


def test_a_killed_node_stops_the_trainer_and_a_new_one_resumes(tmp_path):
    """SIGKILL of the node mid-run: the trainer exits non-zero, its one error line names the
    node and the newest checkpoint, which verifies; `--resume` with a fresh node continues to
    the losses the run had before the node died: resumed from the checkpoint before the newest
    (the newest set aside), its two steps are the killed run's next two, whose losses it logged
    before the node died (the step after a checkpoint computes its loss before it updates)."""
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    node = Node(tmp_path)
    run = tmp_path / "run"
    try:
        trainer = _tierlm("train", *TRAIN, *_with_node(node, token), "--max-steps", "100000",
                          "--save-every", "1", "--out", str(run))
        _wait("two checkpoints", lambda: len(_checkpoints(run)) >= 2, trainer)
        node.proc.send_signal(signal.SIGKILL)
        _, err = trainer.communicate(timeout=60)  # well within its --memory-node-timeout
    finally:
        node.stop()
    assert trainer.returncode not in (0, None)
    lines = [ln for ln in err.splitlines() if ln.startswith("tierlm: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    *_, start, newest = _checkpoints(run)
    assert node.address in lines[0] and str(newest) in lines[0], lines[0]
    verify_checkpoint(newest)
    at = int(start.name.removeprefix("step_"))
    killed = _losses(run)
    assert {at + 1, at + 2} <= set(killed)
    newest.rename(tmp_path / newest.name)  # resume from the one before it
    node = Node(tmp_path)  # a fresh node: the state comes back from the checkpoint
    try:
        resumed = _tierlm("train", *TRAIN, *_with_node(node, token), "--resume", str(run),
                          "--max-steps", str(at + 2), "--train.save_final", "false")
        out, err = resumed.communicate(timeout=300)
    finally:
        node.stop()
    assert resumed.returncode == 0, err
    assert f"resumed from {start}" in out + err
    got = _losses(run)
    assert [got[s] for s in (at + 1, at + 2)] == [killed[s] for s in (at + 1, at + 2)]


def test_a_wrong_token_is_refused_naming_the_token_file(node, tmp_path, capsys):
    """Refused at the handshake, before the model is loaded: one error line naming the token
    file's flag and the node; the node logs the reason."""
    token = tmp_path / "wrong"
    token.write_bytes(b"not the node's secret")
    token.chmod(0o600)
    code = main(["train", *TRAIN, *_with_node(node, token), "--max-steps", "1",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("tierlm: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--memory-node-token-file" in lines[0] and node.address in lines[0], lines[0]
    node.wait_log("wrong token")


def test_the_node_keeps_a_copy_asked_for_in_its_own_kinds():
    """The engine names the kinds of every copy it fetches: the node re-encodes only when they
    differ from the copy's (a list compared with a tuple once made every fetch reallocate and
    re-encode the copy)."""
    layout = FlatLayout([("w", (64, 32), True), ("b", (64,), False)])
    session = Session(None, NodeOptions(host="127.0.0.1", port=1, memory_bytes=2**30,
                                        token=TOKEN), "test")
    session._configure({"optim": {}, "segments": [
        SegmentSpec.of("s", layout, ["bf16", "fp32"]).to_json()]})
    seg = session.segments["s"]
    _, (first,) = session._get_compute_copy({"segment": "s", "kinds": ["bf16", "fp32"]})
    _, (again,) = session._get_compute_copy({"segment": "s", "kinds": ["bf16", "fp32"]})
    assert again is first is seg.wire
    _, (other,) = session._get_compute_copy({"segment": "s", "kinds": ["fp32", "fp32"]})
    assert other is seg.master  # fp32 throughout: the master itself


def test_auto_plans_the_node_and_each_step_moves_the_plans_network_bytes(node, tmp_path,
                                                                          capsys):
    """`--offload-policy auto` with a memory node: the planner, given the node's memory (capped
    by what the handshake reported) and its link, puts state host RAM cannot hold on the node
    before the disk; the run places exactly the plan's segments there, on a simulated rtx4090
    whose time model has the node's link, and every step moves on the network exactly the bytes
    the plan counts, each way."""
    from transformers import AutoConfig

    from tierlm.cli import build_parser, config_from_args
    from tierlm.plan.inputs import plan_auto

    flags = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "2",
             "--data.vocab_size", "1024", "--grad-accum-steps", "2", "--precision", "fp32",
             "--device", "sim:rtx4090", "--offload-policy", "auto", "--device-budget", "6MiB",
             "--host-budget", "8MiB", "--memory-node-memory", "1GiB", "--net-bandwidth",
             "100Gbit", "--eval-every", "0", "--train.sample_tokens", "0",
             "--memory-node", node.address, "--memory-node-token-file",
             str(_token_file(tmp_path)), "--memory-node-timeout", "30"]
    run = tmp_path / "run"
    assert main(["train", *flags, "--max-steps", "2", "--out", str(run)]) == 0
    said = capsys.readouterr().out
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "step" in r]
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    hello = SimpleNamespace(memory_bytes=2**30, link_up_bytes_per_s=None,
                            link_down_bytes_per_s=None)  # the node's --memory; the link given
    # the model as the run built it (its vocabulary from the data), as its export wrote it
    plan = plan_auto(cfg, AutoConfig.from_pretrained(run / "hf"), "fp32", node=hello)
    assert any(p.remote for p in plan.placements), plan.placements
    up, down = plan.moved_bytes["net_send"], plan.moved_bytes["net_recv"]
    assert up > 0 and down > 0
    assert len(steps) == 2
    for r in steps:
        assert (r["net_send_bytes"], r["net_recv_bytes"]) == (up, down), r
    held = sum(p.remote for p in plan.placements)
    assert f"memory node {node.address}: holds the master and optimizer state of {held} of " \
        f"{len(plan.placements)} segments" in said, said



def test_plan_and_probe_measure_the_node_at_its_handshake(node, tmp_path, capsys):
    """`tierlm plan --memory-node` connects for the handshake (the node's memory and the link
    measured) and plans on it, leaving the node free; `tierlm probe --memory-node` prints the
    rate each way and the plan flags; a missing token file is one error line naming its flag."""
    token = str(_token_file(tmp_path))
    args = ["--model-size", "tiny", "--seq-len", "32", "--batch-size", "2",
            "--grad-accum-steps", "2", "--precision", "fp32", "--device", "sim:rtx4090",
            "--offload-policy", "auto", "--device-budget", "16MiB", "--host-budget", "20MiB",
            "--memory-node", node.address, "--memory-node-token-file", token,
            "--net-bandwidth", "100Gbit",  # a fast link: loopback on loaded cores is not one
            "--no-optimizer-table"]
    assert main(["plan", *args]) == 0
    out, err = capsys.readouterr()
    assert f"memory node {node.address}: holds up to 1.00 GiB" in err
    # its memory as the node reported it (1 GiB, less the plan's 10% margin), state placed there
    assert "of its usable 921.60 MiB" in out and "memory node: state of" in out, out
    assert main(["probe", "--memory-node", node.address, "--memory-node-token-file",
                 token]) == 0
    out = capsys.readouterr().out
    assert "to node GB/s" in out and "--net-bandwidth" in out and "--memory-node-memory 1.00GiB" \
        in out, out
    with node.connect("socket") as client:  # neither left a session behind
        assert client.hello.memory_bytes == 2**30
    assert main(["probe", "--memory-node", node.address]) == 2
    assert "--memory-node-token-file" in capsys.readouterr().err


def test_a_checkpoint_of_remote_segments_holds_one_parameter_at_a_time(node, tmp_path):
    """What a checkpoint writes of a remote segment is fetched a parameter at a time (a ranged
    `get_state`), as a disk segment's is read: host staging never holds a segment's copies
    (at 7B a block's master and AdamW slots are 2.4 GB), only the part being written."""
    from tierlm.memory.tiers import TensorClass
    from tierlm.runtime.state import opened

    with node.connect("socket") as client:
        eng = new_engine(copy.deepcopy(tiny_model("llama_tied_gqa", layers=3)),
                         tmp_path / "off", placements=REMOTE, microbatch_order="layer-outer",
                         micro_batches=M, grad_clip=CLIP, node=client)
        eng.step(batches(1, M, seed=3)[0], LR)
        eng.synchronize()
        key = (Tier.HOST, TensorClass.STAGING)
        before = eng.ledger.current_bytes[key]
        largest = max(4 * p.numel for st in eng.states if st.placement.remote
                      for p in st.layout.slots)
        seen, parts = 0, 0
        for name, weights, optim in eng.state_shards():
            remote = eng.states[[st.seg.name for st in eng.states].index(name)].placement.remote
            for t in (*weights.values(), *optim.values()):
                with opened(t):
                    if remote:
                        parts += 1
                        seen = max(seen, eng.ledger.current_bytes[key] - before)
        eng.close()
    assert parts and 0 < seen <= largest, (seen, largest)
