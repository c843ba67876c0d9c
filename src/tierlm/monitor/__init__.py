"""Monitoring pieces the runtime calls into (today: the step timeline trace); the rest of
monitoring still lives in tierlm.train (ARCHITECTURE.md section 9)."""

from tierlm.monitor.trace import NO_TRACER, NoTracer, TraceEvent, Tracer

__all__ = ["NO_TRACER", "NoTracer", "TraceEvent", "Tracer"]
