"""Run records (metrics.jsonl, heartbeat) and progress display."""

from ftrain.metrics.jsonl import Heartbeat, MetricsWriter, read_records
from ftrain.metrics.progress import Progress, format_duration

__all__ = ["Heartbeat", "MetricsWriter", "Progress", "format_duration", "read_records"]
