"""Host RNG states (Python, NumPy, torch CPU, CUDA) as JSON-safe data.

ftrain's own randomness comes from the key chain in the state (:mod:`ftrain.rng`);
these global generators are saved only for user code that draws from them. Everything is
plain JSON (lists of ints, base64 strings): loading a checkpoint never unpickles.
"""

from __future__ import annotations

import base64
import random

import torch

__all__ = ["capture", "restore"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def capture() -> dict:
    """Capture the global RNG states of this process.

    Returns:
        ``{"python": ..., "numpy": ..., "torch_cpu": ..., "cuda": [...] }`` (``numpy``
        only if numpy is importable, ``cuda`` only if CUDA is initialised).

    Example:
        >>> sorted(capture())[:2]
        ['numpy', 'python']
    """
    version, internal, gauss = random.getstate()
    out: dict = {"python": {"version": version, "state": list(internal), "gauss": gauss}}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    out["torch_cpu"] = _b64(torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore(states: dict) -> None:
    """Set the global RNG states captured by :func:`capture` (missing parts are skipped).

    Raises:
        ValueError: a state has the wrong shape or type.
    """
    try:
        if "python" in states:
            p = states["python"]
            random.setstate((int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss"]))
        if "numpy" in states:
            import numpy as np

            n = states["numpy"]
            keys = np.asarray(n["keys"], dtype=np.uint32)
            np.random.set_state(
                (
                    str(n["name"]),
                    keys,
                    int(n["pos"]),
                    int(n["has_gauss"]),
                    float(n["cached_gaussian"]),
                )
            )
        if "torch_cpu" in states:
            torch.set_rng_state(_unb64(states["torch_cpu"]))
        if "cuda" in states and torch.cuda.is_available():
            for i, s in enumerate(states["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(_unb64(s), i)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot restore host RNG states: {e!r}") from e
