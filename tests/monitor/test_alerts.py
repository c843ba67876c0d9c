"""Each alert fires on an injected condition (once per episode) and stays quiet on a clean run;
the thrashing plan is what the stream cache really does."""

import random
import statistics
import time

import pytest
import torch

from tests.monitor_helpers import quiet, tiny_corpus, tiny_run_cfg
from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.monitor.alerts import (
    Alerts,
    DiskSlow,
    GpuThrottle,
    LossSpikeDetector,
    NonFinite,
    Thrashing,
    planned_fetches,
)
from tierlm.monitor.metrics import read_metrics
from tierlm.monitor.nvml import NvmlSampler, open_gpu_sampler, reason_names
from tierlm.runtime import EngineOptions, build_engine
from tierlm.train import Trainer


def steps_of(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


# -- the loss-spike rule ----


def test_loss_spike_detector_fires_once_per_spike_and_ignores_noise():
    rng = random.Random(0)
    d = LossSpikeDetector()
    noise = [3.0 + 0.01 * rng.gauss(0, 1) for _ in range(60)]
    assert not any(d.update(x) for x in noise)
    assert d.window_var is not None and d.baseline_var is not None
    after = [3.0, 3.0, 6.0] + [3.0 + 0.01 * rng.gauss(0, 1) for _ in range(12)]
    fired = [d.update(x) for x in after]
    assert fired == [False, False, True] + [False] * 12  # once, while the spike is in the window
    assert not d.spiking  # re-armed once the spike left the window


def test_loss_spike_needs_history_and_ignores_non_finite():
    d = LossSpikeDetector(window=10)
    # no verdict before 2 windows of losses: a spike at step 15 is not compared with anything
    assert not any(d.update(x) for x in [3.0] * 14 + [30.0] + [3.0] * 4)
    d.reset()
    assert not any(d.update(x) for x in [3.0, float("nan"), float("inf")] * 10)
    assert len(d.losses) == 10 and all(x == 3.0 for x in d.losses)


def test_loss_spike_factor_is_ten_times_the_trailing_mean():
    """The bar is 10x the mean of the last 100 windowed variances: a loss that lifts the
    window's variance to 9.9x that mean passes, one that lifts it to 10.1x alerts."""
    rng = random.Random(0)
    quiet_part = [3.0 + 0.1 * rng.gauss(0, 1) for _ in range(120)]
    windows = [quiet_part[i - 10 : i] for i in range(10, len(quiet_part) + 1)]
    baseline = statistics.fmean(statistics.pvariance(w) for w in windows[-100:])
    last = quiet_part[-9:]  # the window the next loss completes

    def loss_at(ratio):
        """The next loss (above the window's mean) whose window has `ratio` x the baseline."""
        lo, hi = statistics.fmean(last), 100.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if statistics.pvariance([*last, mid]) < ratio * baseline else (
                lo, mid)
        return lo

    for ratio, alerts in ((9.9, False), (10.1, True)):
        d = LossSpikeDetector()
        assert not any(d.update(x) for x in quiet_part)
        assert d.update(loss_at(ratio)) is alerts, ratio
        assert d.window_var == pytest.approx(ratio * baseline, rel=1e-9)


# -- detectors on records ----


def test_non_finite_thrashing_disk_and_gpu_detectors_on_records():
    alerts = Alerts([NonFinite(), Thrashing(), DiskSlow({"disk_read": 1e9}, window=3),
                     GpuThrottle()])
    clean = {"loss": 3.0, "grad_norm": 1.0, "skipped": False, "segments_over_plan": {},
             "disk_read_bytes": 10**8, "disk_read_Bps": 9e8,
             "gpu_throttle_reasons": ["gpu_idle", "applications_clocks_setting"]}
    for _ in range(5):
        assert alerts.check(dict(clean)) == []
    bad = dict(clean, loss=float("nan"), grad_norm=float("inf"), skipped=True,
               segments_over_plan={"block.1": [3, 2]},
               gpu_throttle_reasons=["hw_thermal_slowdown"])
    names = [n for n, _ in alerts.check(bad)]
    assert names == ["non_finite", "thrashing", "gpu_throttle"]
    assert [n for n, _ in alerts.check(bad)] == ["non_finite", "thrashing"]  # throttle: once
    slow = dict(clean, disk_read_Bps=1e8)  # 10x below the 1 GB/s reference
    fired = [[n for n, _ in alerts.check(dict(slow))] for _ in range(4)]
    # the window's throughput (its bytes / its seconds) is under 20% of the reference once two
    # of its three steps are slow (3e8 B / 2.1 s); it alerts once
    assert fired == [[], ["disk_slow"], [], []]
    assert alerts.counts == {"non_finite": 2, "thrashing": 2, "disk_slow": 1, "gpu_throttle": 1}


class FakeNvml:
    """Stands in for pynvml: the calls NvmlSampler makes, with settable answers."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, reasons: int = 0, init_error: bool = False) -> None:
        self.reasons, self.init_error = reasons, init_error

    def nvmlInit(self):
        if self.init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return 2520

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1410 if self.reasons & 0x40 else 2520

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 91 if self.reasons & 0x40 else 60

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_000

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self.reasons


def test_nvml_sampler_reads_fields_and_the_throttle_alert_follows_it():
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml, handle=object())
    assert sampler.pcie_peak_Bps == pytest.approx(16 * 16e9 * 128 / 130 / 8)  # PCIe 4.0 x16
    detector = GpuThrottle()
    assert sampler.sample() == {"gpu_sm_clock_mhz": 2520, "gpu_max_sm_clock_mhz": 2520,
                                "gpu_temp_c": 60, "gpu_power_w": 350.0,
                                "gpu_throttle_reasons": []}
    assert detector.check(sampler.sample()) is None
    nvml.reasons = 0x40 | 0x1
    rec = sampler.sample()
    assert rec["gpu_throttle_reasons"] == ["gpu_idle", "hw_thermal_slowdown"]
    msg = detector.check(rec)
    assert "hw_thermal_slowdown" in msg and "1410 MHz" in msg and "91 C" in msg
    nvml.reasons = 0x1  # idle only: not throttling
    assert detector.check(sampler.sample()) is None
    assert reason_names(0x4 | 0x80) == ["sw_power_cap", "hw_power_brake_slowdown"]


def test_no_gpu_or_no_nvml_gives_null_fields():
    cpu = open_gpu_sampler(torch.device("cpu"), nvml=FakeNvml())
    broken = open_gpu_sampler(torch.device("cuda"), nvml=FakeNvml(init_error=True))
    for sampler in (cpu, broken):
        assert sampler.pcie_peak_Bps is None
        assert set(sampler.sample().values()) == {None}


# -- the thrashing plan against the real cache ----


@pytest.mark.parametrize(
    "name,policy,order,m,resident",
    [
        ("llama_tied_gqa", "host", "microbatch-outer", 2, None),
        ("llama_tied_gqa", "host", "layer-outer", 2, None),
        ("gpt2", "disk", "microbatch-outer", 1, None),
        ("llama_untied", "host", "microbatch-outer", 2, "embed|head"),
    ],
)
def test_planned_fetches_are_what_the_engine_fetches(name, policy, order, m, resident,
                                                     tmp_path):
    engine = build_engine(
        tiny_model(name, layers=3), OPTIM,
        EngineOptions(policy=policy, microbatch_order=order, resident=resident,
                      offload_dir=str(tmp_path / "off"), batch_size=2, seq_len=16,
                      micro_batches=m),
        device=torch.device("cpu"),
    )
    plan = planned_fetches(engine.cache, engine.stream_plan(m))
    assert sum(plan.values()) > 0
    for step in batches(2, m):
        engine.step(step, 1e-3)  # the background updates make later prefetches wait
        assert engine.cache.fetches == plan
    engine.close()


# -- end to end through the trainer ----


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def test_loss_spike_alert_fires_on_a_learning_rate_blow_up(corpus, tmp_path, capsys):
    t = Trainer(tiny_run_cfg(tmp_path, corpus, max_steps=26), log=quiet)
    step = t.stepper.step
    # the update of step 23 uses a 3000x learning rate: the loss jumps from ~2.7 to ~50
    t.stepper.step = lambda b, lr: step(b, lr * 3000 if t.step == 22 else lr)
    t.train()
    recs = steps_of(tmp_path)
    fired = [(r["step"], r["alerts"]) for r in recs if r["alerts"]]
    assert fired == [(24, ["loss_spike"])], fired
    assert "step 24: alert loss_spike: loss spike: variance of the last 10 losses" in (
        capsys.readouterr().out
    )


def test_non_finite_alert_fires_on_an_inf_gradient(corpus, tmp_path, capsys):
    t = Trainer(tiny_run_cfg(tmp_path, corpus, max_steps=4), log=quiet)
    step, victim = t.stepper.step, t.stepper.params[0]

    def poisoned(b, lr):
        if t.step != 2:
            return step(b, lr)
        handle = victim.register_hook(lambda g: torch.full_like(g, float("inf")))
        try:
            return step(b, lr)
        finally:
            handle.remove()

    t.stepper.step = poisoned
    t.train()
    recs = steps_of(tmp_path)
    assert [r["alerts"] for r in recs] == [[], [], ["non_finite"], []]
    assert recs[2]["skipped"] and recs[2]["skipped_steps"] == 1
    assert "step 3: alert non_finite: non-finite step" in capsys.readouterr().out


def test_thrashing_alert_fires_when_the_cache_shrinks_under_the_plan(corpus, tmp_path):
    t = Trainer(tiny_run_cfg(tmp_path, corpus, policy="host", max_steps=4), log=quiet)
    engine = t.stepper
    step = engine.step

    def squeezed(b, lr):
        if t.step == 2:  # from step 3 on, room for only what one action needs at once
            plan = engine.stream_plan(1)
            engine.cache.capacity_bytes = max(
                sum(engine.cache._bytes(s) for s in segs) for segs in plan
            )
        return step(b, lr)

    engine.step = squeezed
    t.train()
    engine.close()
    recs = steps_of(tmp_path)
    assert [r["alerts"] for r in recs] == [[], [], ["thrashing"], ["thrashing"]]
    assert recs[2]["segments_fetched"] > recs[2]["segments_fetched_planned"]
    over = recs[2]["segments_over_plan"]
    assert over and all(got > plan for got, plan in over.values())
    assert "thrashing: segments fetched more often than the schedule plans" in (
        recs[2]["alert_messages"][0]
    )


def test_disk_slow_alert_fires_when_disk_reads_slow_down(corpus, tmp_path, monkeypatch):
    t = Trainer(tiny_run_cfg(tmp_path, corpus, policy="disk", max_steps=9), log=quiet)
    detector = next(d for d in t.monitor.alerts.detectors if isinstance(d, DiskSlow))
    assert detector.reference_Bps["disk_read"] > 0 and detector.reference_Bps["disk_write"] > 0
    import tierlm.memory.disk as disk_module

    pread = disk_module._pread_at_least
    step = t.stepper.step

    def throttled(b, lr):
        # from step 6 on every read takes 80 ms longer: a disk gone slow. (20 ms was too little
        # on two loaded cores: a tiny run's read can take 5-10 ms there, and the rolling window
        # at step 9 still holds one fast step, so the fall stayed above the alert's 5x.)
        if t.step == 5:
            def slow_pread(*args, **kwargs):
                time.sleep(0.08)
                return pread(*args, **kwargs)

            monkeypatch.setattr(disk_module, "_pread_at_least", slow_pread)
        return step(b, lr)

    t.stepper.step = throttled
    t.train()
    t.stepper.close()
    recs = steps_of(tmp_path)
    fired = [r["step"] for r in recs if "disk_slow" in r["alerts"]]
    assert len(fired) == 1 and fired[0] >= 6, fired  # once, after the slow-down
    assert all(r["alerts"] in ([], ["disk_slow"]) for r in recs)
    assert "disk read" in recs[fired[0] - 1]["alert_messages"][0]  # writes may be slow too


def test_disk_slow_judges_against_the_runs_own_start_when_that_is_slower_than_the_probe():
    # a run whose disk requests share two cores with its compute: 5x below the probe from its
    # first step, steady: not a disk gone slow, no alert
    d = DiskSlow({"disk_read": 1e9}, window=3)
    steady = {"disk_read_bytes": 10**8, "disk_read_Bps": 1.5e8}
    assert [d.check(dict(steady)) for _ in range(8)] == [None] * 8
    assert d.baseline_Bps == {"disk_read": pytest.approx(1.5e8)}
    # then the disk itself slows 10x: judged against the run's start, it alerts
    fired = [d.check({"disk_read_bytes": 10**8, "disk_read_Bps": 1.5e7}) for _ in range(3)]
    assert fired[0] is None and fired[1] is not None and fired[2] is None
    # two slow steps of the three: 3e8 B in 14 s
    assert "disk read 21 MB/s vs 150 MB/s" in fired[1], fired[1]
    # a run faster than its probe keeps the probe as the baseline
    d = DiskSlow({"disk_read": 1e9}, window=3)
    for _ in range(3):
        d.check({"disk_read_bytes": 10**8, "disk_read_Bps": 4e9})
    assert d.baseline_Bps == {"disk_read": 1e9}
