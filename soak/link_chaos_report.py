"""The verdict and the table of a link chaos run (:mod:`pdserve.soak.link_chaos`), from its rows.

Each row is one fault case as the driver (:mod:`pdserve.soak.link_chaos_driver`) reports it: its
requests, how they ended and how long they took, and what the workers still held afterwards.
:func:`problems` lists every check that failed; :func:`table_lines` formats the rows as a Markdown
table with a note per case.
"""

from __future__ import annotations

from pdserve.soak.link_chaos_driver import CASES, REQUEST_DEADLINE_S, SETTLE_S, FaultCase


def problems(rows: list[dict]) -> list[str]:
    """Every check that failed, one line each ([] when all held): a hung request, one that ended
    past its case's bound, an error in a case where every request must complete, an error without
    a code or message, a completed request short of tokens or differing from the undisturbed run,
    a worker still holding KV blocks (or not answering) after the case."""
    out = []
    for row in rows:
        if "skipped" in row:
            continue
        name = row["name"]
        if row["hung"]:
            out.append(f"{name}: {row['hung']} request(s) ran into their {REQUEST_DEADLINE_S:.0f}s deadline")
        if row["max_end_s"] > row["bound_s"]:
            out.append(f"{name}: a request ended after {row['max_end_s']:.1f}s (bound {row['bound_s']:.0f}s)")
        if row["errors"] and CASES.get(name, FaultCase(name)).must_complete:
            out.append(f"{name}: errors where every request must complete: {row['messages']}")
        if any(not m.split(": ", 1)[-1] or m.startswith(("UNKNOWN", "hung")) for m in row["messages"]):
            out.append(f"{name}: an error without a clear code and message: {row['messages']}")
        if row["short"] or row["mismatches"]:
            out.append(
                f"{name}: completed requests with wrong tokens: {row['short']} short, "
                f"{row['mismatches']} differ from the undisturbed run"
            )
        if any(row["leaked"].values()):
            out.append(
                f"{name}: workers still hold KV blocks, sequences or KV waits (-1: no answer) "
                f"{SETTLE_S:.0f}s after the last request ended: {row['leaked']}"
            )
    return out


def table_lines(rows: list[dict]) -> list[str]:
    """The table (fault | requests | completed | migrated | errored (codes) | max time to end |
    leaked blocks), then a note per row: where the router ran, when a cut came, why a case was skipped."""
    head = ("fault", "requests", "completed", "migrated", "errored (codes)", "max time to end", "leaked blocks")
    body, notes = [], []
    for row in rows:
        if "skipped" in row:
            body.append((row["fault"], "skipped", "", "", "", "", ""))
            notes.append(f"{row['name']}: skipped: {row['skipped']}")
            continue
        codes = {**row["errors"], **({"hung": row["hung"]} if row["hung"] else {})}
        listed = ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))
        leaked = sum(max(v, 0) for v in row["leaked"].values())
        body.append(
            (
                row["fault"],
                str(row["requests"]),
                str(row["completed"]),
                str(row["migrated"]),
                f"{sum(codes.values())}" + (f" ({listed})" if listed else ""),
                f"{row['max_end_s']:.1f} s (bound {row['bound_s']:.0f} s)",
                f"{leaked}" + ("" if min(row["leaked"].values(), default=0) >= 0 else " (a worker did not answer)"),
            )
        )
        note = f"{row['name']}: router on the {row.get('router_node') or '?'} node; link shaped by {row['how']}"
        if "cut_at_s" in row:
            note += (
                f"; cut {row['cut_at_s']:.1f} s after the first send, {row['in_flight_at_cut']} request(s) "
                f"between first and second token then"
            )
        notes.append(note + (f"; errors: {'; '.join(row['messages'])}" if row["messages"] else ""))
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]

    def fmt(r: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body), *notes]
