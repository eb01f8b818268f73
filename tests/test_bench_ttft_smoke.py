"""Smoke test of the benchmark sections `ttft` (7), `capacity` (8) and
`footprint` (11) in
their smallest configuration: they run end to end against the emulator and
real daemons and fill their rows. No assertion on any figure: timing belongs
to `python -m scripts.bench`, not to the test suite."""

from __future__ import annotations

import pytest

from scripts.bench import capacity, footprint, long_idle, report, ttft


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_ttft_section_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft, "REPEAT_MIN", 4)  # the "again" burst too, on 4 calls
    monkeypatch.setattr(ttft, "REPEAT_AFTER_S", 0.2)
    monkeypatch.setattr(ttft, "OLD_POOL_BURSTS", (4,))  # the other pools' variants, on 4 calls
    monkeypatch.setattr(ttft, "POOLS", {
        ttft.OLD_POOL: {"workers_spare": 4, "workers_refill_wait_s": 0.0},
        ttft.SPARES_32: {"workers_spare": 4}})
    monkeypatch.setattr(long_idle, "LONG_IDLE_BURST", 4)
    sec = ttft.run(True, 1, bursts=[(1, 3), (4, 3)], long_idle=long_idle.LongIdle(0.5))
    items = [row.item for row in sec.rows]
    assert "burst 1: added p50 (streamfence − SDK)" in items
    assert "burst 4: p90 streamfence ÷ SDK" in items
    assert any(item.startswith("burst 4 again") for item in items)
    assert f"burst 4, {ttft.OLD_POOL}: added p50, p90 ÷ SDK" in items
    assert any(item.startswith("burst 4, idle") and "added p50" in item for item in items)
    assert all(row.met is not None for row in sec.rows if row.target)
    assert "7 TTFT of a burst" in "\n".join(report.table([sec]))


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_capacity_section_smoke() -> None:
    sec = capacity.run(True, 1, top=4, chunks=5, bound_s=30.0)
    items = [row.item for row in sec.rows]
    assert items[-1] == "capacity streamfence ÷ SDK"
    assert len(sec.details) >= 2


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_footprint_section_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pools shrink to their floor within seconds, not the default's minutes.
    fast = {"workers_peak_half_life_s": 0.5}
    monkeypatch.setitem(footprint.POLICIES, "default", {**footprint.POLICIES["default"], **fast})
    monkeypatch.setitem(footprint.POLICIES, "old policy", {
        "workers_spare": 4, "workers_max": 16, "workers_refill_wait_s": 0.0, **fast})
    sec = footprint.run(True, 1)
    items = [row.item for row in sec.rows]
    assert items == ["idle tree, default: USS (PSS)", "idle tree, old policy: USS (PSS)"]
    assert sec.rows[0].met is not None and len(sec.details) == 2
