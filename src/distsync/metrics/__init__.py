"""Events, phase accounting and run summaries (throughput, time to target, bytes, waiting)."""

from distsync.metrics.summary import (counted_events, device_summary, device_warning, eval_curve,
                                      split_collective_wait, summarize)

__all__ = ["counted_events", "device_summary", "device_warning", "eval_curve", "split_collective_wait", "summarize"]
