"""Checkpoints: Zarr v3 step stores, an atomic commit protocol, policies and a manager.

Public API (re-exported by ``ftrain``): :class:`CheckpointManager`, the save policies
(:class:`EveryNSteps`, :class:`EveryNSeconds`), the keep policies (:class:`LatestN`,
:class:`EveryKSteps`, :class:`BestN`, :class:`YoungerThan`, :class:`KeepAll`),
:class:`AnyOf`, and the errors. Modules: ``format`` (chunk and metadata encoding),
``store`` (write/read a tree), ``commit`` (the protocol), ``location`` (path or URL),
``objstore`` + ``objio`` (object storage through zarr-python's ``ObjectStore``),
``policies``, ``index``, ``hostrng``, ``manager``; ``python -m ftrain.ckpt`` is the command-line tool.
``zdtype`` registers the ``bfloat16`` and float8 Zarr data types with zarr-python on import,
so after ``import ftrain`` a plain ``zarr.open_group(step)`` reads bf16 leaves as bf16.
"""

from ftrain.ckpt import zdtype  # noqa: F401  (registers the data types; format imports it too)
from ftrain.ckpt.format import (
    CheckpointAccessError,
    CheckpointFormatError,
    CheckpointReadError,
    CorruptCheckpointError,
)
from ftrain.ckpt.incremental import LeafChangedError
from ftrain.ckpt.location import CheckpointLocationError, CheckpointStoreError
from ftrain.ckpt.manager import CheckpointManager, CheckpointNotFoundError, CheckpointSaveError
from ftrain.ckpt.policies import (
    AnyOf,
    BestN,
    EveryKSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    LatestN,
    YoungerThan,
)
from ftrain.ckpt.writerlock import CheckpointDirInUseError

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointDirInUseError",
    "CheckpointFormatError",
    "CheckpointLocationError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointAccessError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "CheckpointStoreError",
    "CorruptCheckpointError",
    "LeafChangedError",
    "EveryKSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "LatestN",
    "YoungerThan",
]
