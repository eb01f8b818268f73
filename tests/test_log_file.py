"""`log_file` (config `[daemon]`): the daemon's log goes to a file instead of
stderr, begun anew once it holds `log_file_max_bytes` (the old one renamed
FILE.1, FILE.1 to FILE.2, ...), keeping `log_file_backups` old files. The
real daemon, with a small size; and the keys' checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from streamfence.config.model import ConfigError, DaemonConfig, load_config, parse_config
from tests.harness import wait_until
from tests.wires import request_for

MAX_BYTES = 4096
BACKUPS = 2


def test_the_defaults_and_the_checks() -> None:
    defaults = DaemonConfig()
    assert (defaults.log_file, defaults.log_file_max_bytes, defaults.log_file_backups) == \
        ("", 50 * 1024 * 1024, 5)
    cfg = parse_config({"daemon": {"log_file": "/var/log/sf.log", "log_file_max_bytes": 0,
                                   "log_file_backups": 1}})
    assert (cfg.log_file, cfg.log_file_max_bytes, cfg.log_file_backups) == \
        ("/var/log/sf.log", 0, 1)
    with pytest.raises(ConfigError) as bad:
        parse_config({"daemon": {"log_file_backups": 0, "log_file_max_bytes": -1,
                                 "log_file": 3}})
    assert sorted(bad.value.problems) == [
        "<config>: daemon.log_file: expected str, got int",
        "<config>: daemon.log_file_backups: must be >= 1",
        "<config>: daemon.log_file_max_bytes: must not be negative"], bad.value.problems
    with pytest.raises(ConfigError, match="STREAMFENCE_LOG_FILE_BACKUPS: must be >= 1"):
        load_config(None, {"STREAMFENCE_LOG_FILE_BACKUPS": "0"})
    assert load_config(None, {"STREAMFENCE_LOG_FILE": "x.log"}).log_file == "x.log"


@pytest.mark.slow
def test_the_log_file_is_rotated_at_its_size(make_daemon: Any, tmp_path: Path) -> None:
    log_file = tmp_path / "sf.log"
    daemon = make_daemon(daemon={"log_file": str(log_file), "log_file_max_bytes": MAX_BYTES,
                                 "log_file_backups": BACKUPS})
    with daemon.client() as client:
        for n in range(6):  # each call logs some 2 KiB of JSON lines
            call_id = client.submit("emu", request_for("openai", f"rotate{n}"),
                                    subscribe=False)
            assert client.result(call_id, wait_s=30.0) is not None

    def written() -> bool:  # the last call's last line is in
        return f'"call_id": "{call_id}"' in log_file.read_text() and \
            "call completed" in log_file.read_text() + _older(log_file, 1)

    wait_until(written, 10, "the last call's lines in the log file")
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sf.log"))
    assert files == ["sf.log", *(f"sf.log.{n}" for n in range(1, BACKUPS + 1))], files
    for name in files:
        text = (tmp_path / name).read_text()
        assert 0 < len(text.encode()) <= MAX_BYTES, (name, len(text))
        for line in text.splitlines():  # whole records: a file begins and ends with one
            assert json.loads(line)["level"], line
    assert not daemon.log_text().strip(), daemon.log_text()[-2000:]  # nothing on stderr


def _older(log_file: Path, n: int) -> str:
    older = log_file.with_name(f"{log_file.name}.{n}")
    return older.read_text() if older.exists() else ""
