"""Run records (metrics.jsonl, heartbeat), progress display and the ``logger=`` loggers."""

from ftrain.metrics.jsonl import Heartbeat, MetricsWriter, read_records
from ftrain.metrics.loggers import (
    CsvLogger,
    LoggerError,
    LoggerSet,
    RunInfo,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    check_loggers,
)
from ftrain.metrics.progress import Progress, format_duration, format_field, memory_fields

__all__ = [
    "CsvLogger",
    "Heartbeat",
    "LoggerError",
    "LoggerSet",
    "MetricsWriter",
    "Progress",
    "RunInfo",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "check_loggers",
    "format_duration",
    "format_field",
    "memory_fields",
    "read_records",
]
