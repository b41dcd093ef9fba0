"""Events, phase accounting and run summaries (throughput, time to target, bytes, waiting)."""

from distsync.metrics.summary import split_collective_wait, summarize, eval_curve

__all__ = ["split_collective_wait", "summarize", "eval_curve"]
