"""Smoke test of the benchmark sections `ttft` (7) and `capacity` (8) in
their smallest configuration: they run end to end against the emulator and
real daemons and fill their rows. No assertion on any figure: timing belongs
to `python -m scripts.bench`, not to the test suite."""

from __future__ import annotations

import pytest

from scripts.bench import capacity, report, ttft


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_ttft_section_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft, "REPEAT_MIN", 4)  # the "again" burst too, on 4 calls
    monkeypatch.setattr(ttft, "REPEAT_AFTER_S", 0.2)
    monkeypatch.setattr(ttft, "DEFAULT_SPARE", 2)  # 32 spares per fresh daemon: minutes here
    sec = ttft.run(True, 1, bursts=[(1, 3), (4, 3)])
    items = [row.item for row in sec.rows]
    assert "burst 1: added p50 (streamfence − SDK)" in items
    assert "burst 4: p90 streamfence ÷ SDK" in items
    assert any(item.startswith("burst 4 again") for item in items)
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
