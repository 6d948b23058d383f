"""DeepSpeed's `comms_logger`: per collective, calls, bytes, latency, algbw and busbw, every optimizer step.

    "comms_logger": {"enabled": true}        (prof_all/prof_ops/verbose/debug: see KEYS)
    python -m zero_from_scratch.engine.wall_clock          # prints the table for 2 steps of a 2-rank run

Cost: one perf_counter pair per collective (engine/comm.py times every call anyway) and a table on rank 0.
Rows come from the engine's ledger (Comm.last_step: one Usage per purpose), grouped like DeepSpeed's
log_summary by collective and message size. Bandwidths as nccl-tests defines them (its PERFORMANCE.md):
  algbw = S / t                  S = the full buffer (all-reduce's tensor; reduce-scatter's input;
                                 all-gather's output), t = the call's wall time
  busbw = algbw · factor         factor 2(N-1)/N all-reduce, (N-1)/N reduce-scatter / all-gather, 1 broadcast
so busbw · t is what one rank of a ring sends: the ledger's measured bytes (checked in the tests).
DeepSpeed's own log_summary prints "tput" = algbw except for all-reduce, where it prints 2·S/t.
"""
from __future__ import annotations

from primitives.engine.cost import ring_fraction
from zero_from_scratch.engine.key_status import enabled_section

KEYS = {"enabled", "prof_all", "prof_ops", "verbose", "debug"}


def parse(raw: dict) -> dict | None:
    """The section, validated: {"enabled", "prof_ops"} or None when off."""
    s = enabled_section(raw, "comms_logger", KEYS)
    if s is None:
        return None
    ops = s.get("prof_ops", [])
    if not isinstance(ops, list):
        raise ValueError(f"config key 'comms_logger.prof_ops' = {ops!r} is invalid; allowed: a list of collective names")
    return {"enabled": True, "prof_ops": None if s.get("prof_all", True) or not ops else list(ops)}


def factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor."""
    return 1.0 if collective == "broadcast" else float(ring_fraction(collective, n))


def rows(usage: dict, n: int, prof_ops=None) -> list[dict]:
    """One row per (collective, purpose) of a Comm.usage dict."""
    out = []
    for purpose, u in sorted(usage.items()):
        name = u.collective.replace("_single", "")
        if prof_ops is not None and name not in prof_ops and u.collective not in prof_ops:
            continue
        t = max(u.seconds, 1e-12)
        algbw = u.payload / t
        out.append({"collective": name, "purpose": purpose, "calls": u.calls, "bytes": u.payload,
                    "msg_bytes": u.payload // max(u.calls, 1), "total_ms": 1e3 * u.seconds,
                    "avg_ms": 1e3 * u.seconds / max(u.calls, 1), "algbw_gbps": 8 * algbw / 1e9,
                    "busbw_gbps": 8 * algbw * factor(u.collective, n) / 1e9, "sent": u.sent, "formula": u.formula})
    return out


def render(rs: list[dict], step: int):
    """A rich table like DeepSpeed's log_summary."""
    from rich.table import Table       # rich only when a table is drawn
    t = Table(title=f"comms_logger, optimizer step {step} (rank 0)")
    for c in ("Comm. Op", "Purpose", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
              "algbw (Gbps)", "busbw (Gbps)"):
        t.add_column(c, justify="left" if c in ("Comm. Op", "Purpose") else "right")
    for r in rs:
        t.add_row(r["collective"], r["purpose"], f"{r['msg_bytes']:,} B", str(r["calls"]), f"{r['total_ms']:.2f}",
                  f"{r['avg_ms']:.3f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
    return t
