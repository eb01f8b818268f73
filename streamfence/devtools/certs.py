"""A throwaway TLS certificate for 127.0.0.1, for the emulator's TLS port in
tests and benches: self-signed (ECDSA P-256, as the big providers' fronts
use), valid a day, made by the `openssl` command line (no Python crypto
dependency for a development tool). A client trusts it as its own CA:
`ssl.create_default_context(cafile=cert)`, or `SSL_CERT_FILE=cert` for a
daemon's workers."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(where: Path) -> tuple[Path, Path]:
    """Writes cert.pem and key.pem into `where`; returns (certificate, key)."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key
