"""SSD wear: disk-tier writes projected against the drive's rated endurance, in the plan and in
every run that writes to the disk tier."""

import json

import pytest

from tierlm.cli import main
from tierlm.memory.wear import WARN_SHARE_PER_DAY, DiskWear
from tierlm.monitor.alerts import DiskWearAlert


def test_wear_projects_a_day_against_the_rating():
    # 100 GB written every 36 s: 10 TB an hour, 240 TB a day, 40% of a 600 TBW drive
    w = DiskWear(write_bytes_per_step=100e9, step_s=36.0, endurance_tbw=600)
    assert w.write_bytes_per_hour == pytest.approx(10e12)
    assert w.share_per_day == pytest.approx(0.4)
    assert w.days_to_rated == pytest.approx(2.5)
    assert "40% of a 600 TBW" in w.describe() and "2.5 days" in w.describe()
    assert "--disk-endurance-tbw" in w.warning() and "--host-budget" in w.warning()


def test_wear_warns_just_above_the_threshold_only():
    day_bytes = WARN_SHARE_PER_DAY * 600e12  # exactly the warning share of a 600 TBW drive
    per_step = day_bytes / 86_400  # one-second steps
    assert DiskWear(write_bytes_per_step=per_step * 0.99, step_s=1.0).warning() is None
    assert DiskWear(write_bytes_per_step=per_step * 1.01, step_s=1.0).warning() is not None


def test_plan_reports_wear_from_its_own_bytes_and_step(capsys):
    # a 4090 capped at 2 GiB with 2 GiB of RAM spills 125M's state to disk as 64 GiB does 7B's,
    # at a fifth of the search's time (fewer segments)
    flags = ["plan", "--model-size", "125m", "--hardware", "rtx4090", "--gpu-memory", "2GiB",
             "--host-memory", "2GiB", "--disk-budget", "200GiB", "--batch-size", "4",
             "--seq-len", "2048", "--grad-accum-steps", "8", "--disk-endurance-tbw", "1200",
             "--no-optimizer-table"]
    assert main([*flags, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    written = p["moved_bytes"]["disk_write"]
    assert written > 0 and p["disk_wear"]["write_bytes_per_step"] == written
    share = written * 86_400 / p["times_s"]["step"] / 1200e12
    assert p["disk_wear"]["share_per_day"] == pytest.approx(share)
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert f"{share * 100:.3g}% of a 1200 TBW drive" in text
    assert ("WARNING" in text) == (share > WARN_SHARE_PER_DAY)


def test_run_alert_fires_once_after_warmup_and_summarises():
    alert = DiskWearAlert(endurance_tbw=1.0, warmup=3)  # 1 TBW: any real rate is too high
    rec = {"disk_write_bytes": 2**30, "step_time_s": 2.0}
    fired = [alert.check(dict(rec)) for _ in range(5)]
    assert fired[:2] == [None, None] and fired[2] is not None and fired[3:] == [None, None]
    assert alert.check({"disk_write_bytes": 0, "step_time_s": 1.0}) is None  # no disk: no count
    assert alert.steps == 5
    assert "measured over 5 steps: disk writes: 1.00 GiB/step" in alert.summary()
    quiet = DiskWearAlert(endurance_tbw=1e9)
    assert all(quiet.check(dict(rec)) is None for _ in range(5))
