"""Zarr data types for the floats numpy lacks (``bfloat16``, float8), backed by ml_dtypes.

tensorstore and Orbax write a bf16 array with the ``"bfloat16"`` data type of
zarr-extensions, and float8 arrays as ``"float8_e4m3fn"``, ``"float8_e5m2"``, ... (the
ml_dtypes names, which are also torch's). zarr-python 3.1 knows none of them: it refuses
to open such an array. Importing this module registers them in zarr-python's data-type
registry (``zarr.core.dtype.data_type_registry``), so ``zarr.open_group(step, mode="r")``
returns arrays of dtype ``ml_dtypes.bfloat16`` etc. ``ftrain.ckpt`` imports it, so any
``import ftrain`` does. Registering twice is a no-op.

Fill values are encoded as the core spec encodes IEEE floats (a JSON number, ``"NaN"``,
``"Infinity"``, ``"-Infinity"``), or as ``"0x"`` and the big-endian hex of the raw bits
(``"0x7fc0"`` is bfloat16's NaN). zarr-python reads four hex digits as a float16, so the
hex form is decoded here from the bits instead.

Deliberately standalone (numpy, ml_dtypes and zarr; no torch, no other ftrain module):
a reader without ftrain can copy this file (see ``docs/checkpoint-format.md``).
zarr-python 3.1.6 collects ``zarr.data_type`` entry points but never loads them, so an
entry point would not register anything; the import is what does.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.common import endianness_to_numpy_str
from zarr.core.dtype.npy.float import BaseFloat

__all__ = ["ZDTYPES", "BFloat16", "Float8E4M3FN", "Float8E5M2", "register"]


@dataclass(frozen=True, kw_only=True)
class _MLFloat(BaseFloat):
    """A float data type of ml_dtypes: zarr-python's float behaviour with its own name,
    item size and hex fill values. Zarr v3 only (these types have no Zarr v2 name).

    The numpy dtype is looked up when zarr-python first needs it, not at class creation:
    importing ml_dtypes costs ~0.6 s (measured), which every ``import ftrain`` would pay
    for a type that only readers of these arrays use."""

    dtype_cls = None  # type: ignore[assignment]  # see native()
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()
    _item_size: ClassVar[int]

    @classmethod
    def native(cls) -> np.dtype:
        """The numpy dtype (native byte order) of ml_dtypes that this type wraps."""
        return np.dtype(getattr(importlib.import_module("ml_dtypes"), cls._zarr_v3_name))

    @classmethod
    def _check_native_dtype(cls, dtype: object) -> bool:
        # a numpy dtype of ml_dtypes exists only once ml_dtypes is imported: never import it here
        return "ml_dtypes" in sys.modules and type(dtype) is type(cls.native())

    def to_native_dtype(self) -> np.dtype:
        return self.native().newbyteorder(endianness_to_numpy_str(self.endianness))

    @property
    def item_size(self) -> int:
        return self._item_size

    def to_json(self, zarr_format):  # type: ignore[override]
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} is a Zarr v3 data type, got {zarr_format=}")
        return self._zarr_v3_name

    def _check_scalar(self, data: object) -> bool:
        # a scalar of this very dtype (what from_json_scalar returns) is not a numpy float
        return isinstance(data, self.to_native_dtype().type) or super()._check_scalar(data)

    def from_json_scalar(self, data, *, zarr_format):  # type: ignore[override]
        if isinstance(data, str) and data.startswith("0x"):
            return self._from_hex(data)
        return super().from_json_scalar(data, zarr_format=zarr_format)

    def _from_hex(self, data: str):
        digits = data[2:]
        if len(digits) != 2 * self.item_size:
            raise ValueError(
                f"fill value {data!r} of a {self._zarr_v3_name} array must have "
                f"{2 * self.item_size} hex digits after '0x'"
            )
        raw = np.array(int(digits, 16), dtype=f"u{self.item_size}")
        return raw.view(self.to_native_dtype())[()]


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat):
    """``bfloat16`` (zarr-extensions ``data-types/bfloat16``; tensorstore, Orbax)."""

    _zarr_v3_name = "bfloat16"
    _item_size = 2


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: no infinities, NaN = ``0x7f``/``0xff`` (tensorstore's name; not
    in zarr-extensions, whose ``float8_e4m3`` is the IEEE-like variant with infinities)."""

    _zarr_v3_name = "float8_e4m3fn"
    _item_size = 1


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2`` (zarr-extensions ``data-types/float8_e5m2``; tensorstore)."""

    _zarr_v3_name = "float8_e5m2"
    _item_size = 1


ZDTYPES: tuple[type[_MLFloat], ...] = (BFloat16, Float8E4M3FN, Float8E5M2)


def register() -> None:
    """Register :data:`ZDTYPES` with zarr-python (idempotent; done on import).

    Example:
        >>> import zarr
        >>> register()
        >>> zarr.create_array({}, shape=(2,), dtype="bfloat16").dtype
        dtype(bfloat16)
    """
    for cls in ZDTYPES:
        data_type_registry.register(cls._zarr_v3_name, cls)


register()
