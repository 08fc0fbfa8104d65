"""`every="auto"`: Young/Daly within bounds, as a table, and the interval follows the observed rate."""

from __future__ import annotations

import math

import pytest

from petctl.elastic.autointerval import CORRELATED_SHARE, AutoInterval, LossModel, young_daly


@pytest.mark.parametrize("cost, rate_per_h, lo, hi, seconds, bound", [
    (2.0, 1.0, 30.0, 3600.0, math.sqrt(2 * 2.0 * 3600.0), ""),  # 120 s
    (0.5, 4.0, 30.0, 3600.0, 30.0, ""),  # sqrt(2 x 0.5 x 900) = 30: exactly the bound, not bounded
    (0.1, 4.0, 30.0, 3600.0, 30.0, "lo"),  # 13 s raw
    (10.0, 0.01, 30.0, 3600.0, math.sqrt(2 * 10.0 * 360000.0), ""),  # 2683 s
    (10.0, 0.001, 30.0, 3600.0, 3600.0, "hi"),  # 8485 s raw
    (10.0, 0.1, 30.0, 3600.0, math.sqrt(2 * 10.0 * 36000.0), ""),  # 848.5 s
    (1.0, 0.0, 30.0, 3600.0, 3600.0, "hi"),  # nothing is ever lost: the upper bound
    (0.0, 5.0, 30.0, 3600.0, 30.0, "lo"),  # free saves: as often as allowed
])
def test_young_daly_table(cost, rate_per_h, lo, hi, seconds, bound) -> None:
    c = young_daly(cost, rate_per_h, lo, hi)
    assert c.seconds == pytest.approx(seconds) and c.bound == bound
    assert "young-daly" in c.reason


def test_the_rate_that_matters_is_losing_every_holder() -> None:
    rate = 1.0  # silent losses per node-hour
    assert LossModel(8, "none").holders_rate(rate) == 8.0
    assert LossModel(8, "replicated").holders_rate(rate) == pytest.approx(CORRELATED_SHARE)
    sharded = LossModel(8, "sharded", window_s=10.0).holders_rate(rate)
    assert sharded == pytest.approx(2 * 8 * 10 / 3600 + CORRELATED_SHARE)
    # snapshots make the durable interval longer: the tier covers single losses
    assert young_daly(1.0, LossModel(8, "none").holders_rate(rate)).seconds < young_daly(
        1.0, LossModel(8, "replicated").holders_rate(rate)).seconds


def test_it_adapts_when_the_observed_rate_changes() -> None:
    auto = AutoInterval(LossModel(nodes=8, tier="none"), prior_rate=0.1, lo=1.0, hi=1e6)
    first = auto.saved(stall_s=0.5, upload_s=1.5)  # cost 2 s, rate 0.8/h -> sqrt(2 x 2 x 4500) = 134 s
    assert first is not None and first.seconds == pytest.approx(math.sqrt(2 * 2.0 * 3600 / 0.8))
    # the job loses nodes 10x faster than the prior said: 8 losses in 8 node-hours -> rate (0.8+8)/16
    faster = auto.observe(losses=8, node_hours=8.0)
    assert faster is not None and faster.seconds < first.seconds
    assert auto.node_rate() == pytest.approx((0.1 * 8 + 8) / 16)
    assert faster.seconds == pytest.approx(math.sqrt(2 * 2.0 * 3600 / (8 * auto.node_rate())))
    # a long quiet stretch brings it back up
    calm = auto.observe(losses=8, node_hours=800.0)
    assert calm is not None and calm.seconds > faster.seconds
    # a change under 20 % is not adopted (no flapping, no event)
    assert auto.observe(losses=8, node_hours=801.0) is None
    assert auto.fields()["interval_s"] == round(calm.seconds, 1) and auto.fields()["losses"] == 8


def test_checkpointer_auto_measures_and_reports(tmp_path, monkeypatch) -> None:
    """A real save sets the interval and says why in one structured line; a bad `every` is refused."""
    import io
    import json

    torch = pytest.importorskip("torch")
    from petctl.elastic import Checkpointer, State
    from petctl.io.eventlog import EventLog

    monkeypatch.setenv("PETCTL_LOSS_RATE", "360")  # silent losses per node-hour: MTBF short, 1 node
    out = io.StringIO()
    model = torch.nn.Linear(64, 64)
    state = State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), extra={})
    ckpt = Checkpointer(url=f"file://{tmp_path}/ck", every="auto", snapshots=False, check_every=0,
                        control_dir=tmp_path / "ctl", log=EventLog("elastic", stream=out))
    try:
        assert ckpt.every == 0 and ckpt.every_seconds == 30.0  # the lower bound until a save is measured
        ckpt.resume(state)
        ckpt.step_end(0, state)
        assert ckpt.save(0, state, block=True) is not None
        lines = [json.loads(x) for x in out.getvalue().splitlines() if '"checkpoint.interval"' in x]
        assert len(lines) == 1, out.getvalue()
        ev = lines[0]
        assert ev["prior"] == "PETCTL_LOSS_RATE" and ev["tier"] == "none" and ev["cost_s"] > 0
        assert ev["interval_s"] == round(ckpt.every_seconds, 1) and "young-daly" in ev["reason"]
    finally:
        ckpt.close()
    with pytest.raises(ValueError, match="'auto'"):
        Checkpointer(url=f"file://{tmp_path}/x", every="often")
