"""The results table (console and markdown) and docs/PERFORMANCE.md.

`write_docs` replaces only the text between BEGIN and END in the page, so
the hand-written analysis around it survives a new run; a page without the
markers is written from scratch with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.bench.common import Section

BEGIN = "<!-- bench:results:begin (written by python -m scripts.bench --write-docs) -->"
END = "<!-- bench:results:end -->"
_MARK = {True: "met", False: "**MISSED**", None: ""}


def table(sections: Sequence[Section]) -> list[str]:
    lines = ["| section | measure | result | target | verdict | reference (ARCHITECTURE §6) |",
             "|---|---|---|---|---|---|"]
    for sec in sections:
        for row in sec.rows:
            cells = [row.section, row.item, row.result, row.target, _MARK[row.met],
                     row.reference]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def details(sections: Sequence[Section]) -> list[str]:
    lines: list[str] = []
    for sec in sections:
        params = ", ".join(f"{k}: {v}" for k, v in sec.params.items())
        lines.append(f"**{sec.title}** ({sec.seconds:.0f} s; {params})")
        lines.append("")
        lines.extend(sec.details or ["- (no details)"])
        lines.append("")
    return lines


def header(meta: dict[str, Any]) -> list[str]:
    m = meta["machine"]
    return [f"Command: `{meta['command']}`",
            "",
            f"Date: {meta['date']} · run time {meta['seconds']:.0f} s · machine: "
            f"{m['nproc']} CPUs ({m['cpu']}), {m['memory']} RAM, {m['python']}, {m['os']} · "
            f"rounds per comparison: {meta['rounds']} · seed {meta['seed']}",
            ""]


def console(sections: Sequence[Section], meta: dict[str, Any]) -> str:
    return "\n".join(["", *header(meta), *table(sections), "", *details(sections)])


def write_docs(path: Path, sections: Sequence[Section], meta: dict[str, Any]) -> None:
    block = "\n".join([BEGIN, "", *header(meta), *table(sections), "",
                       "Details per section (medians over the rounds; the full figures "
                       "behind each line):", "", *details(sections), END])
    if path.exists() and BEGIN in (text := path.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        path.write_text(head + block + tail)
        return
    path.write_text("# Performance\n\nMeasured by `python -m scripts.bench` (see "
                    "scripts/bench/). Every comparison runs side by side in one run, "
                    "variants interleaved and rotated per round, medians reported.\n\n"
                    + block + "\n")
