"""Host RNG states (Python, NumPy, torch CPU, CUDA) as JSON-safe data.

ftrain's own randomness comes from the key chain in the state (:mod:`ftrain.rng`);
these global generators are saved only for user code that draws from them. Everything is
plain JSON (lists of ints, base64 strings): loading a checkpoint never unpickles.
"""

from __future__ import annotations

import base64
import binascii
import random

import torch

from ftrain.ckpt.format import CorruptCheckpointError

_MT_WORDS = 625  # Python's Mersenne Twister state: 624 words + position

__all__ = ["capture", "for_rank", "restore", "seed_all", "validate"]


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


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's CPU/CUDA generators.

    For the trainer's entry points only (library code never touches global RNG): user code
    that draws from the global generators then starts from ``trainer.seed`` too.

    Example:
        >>> seed_all(3); a = random.random(); seed_all(3); a == random.random()
        True
    """
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def restore(states: dict) -> None:
    """Set the global RNG states captured by :func:`capture` (missing parts are skipped).

    Raises:
        ValueError: a state has the wrong shape or type.
    """
    try:
        if "python" in states:
            random.setstate(_python_state(states["python"]))
        if "numpy" in states:
            import numpy as np

            np.random.set_state(_numpy_state(states["numpy"]))
        if "torch_cpu" in states:
            torch.set_rng_state(_unb64(states["torch_cpu"]))
        if "cuda" in states and torch.cuda.is_available():
            for i, s in enumerate(states["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(_unb64(s), i)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"cannot restore host RNG states: {e!r}") from e


def _python_state(p: dict) -> tuple:
    return (int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss"])


def _numpy_state(n: dict) -> tuple:
    import numpy as np

    keys = np.asarray(n["keys"], dtype=np.uint32)
    return (str(n["name"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))


# a CUDA generator's state: its Philox seed and offset, 8 bytes each (what
# torch.cuda.get_rng_state() returns; set_rng_state refuses any other length)
CUDA_STATE_BYTES = 16


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"host RNG state: {what}")


def _is_int(x: object) -> bool:
    return type(x) is int


def _check_python(p: object) -> None:
    _check(isinstance(p, dict), "'python' is not an object")
    state = p.get("state")
    _check(_is_int(p.get("version")), "python version is not an integer")
    _check(
        isinstance(state, list)
        and len(state) == _MT_WORDS
        and all(_is_int(x) and 0 <= x < 2**32 for x in state[:-1])
        and _is_int(state[-1])
        and 0 <= state[-1] <= _MT_WORDS - 1,
        "python state is not 625 32-bit words",
    )
    _check(p.get("gauss") is None or isinstance(p.get("gauss"), float), "python gauss")


def _check_numpy(n: object) -> None:
    _check(isinstance(n, dict), "'numpy' is not an object")
    keys = n.get("keys")
    _check(n.get("name") == "MT19937", "numpy generator is not MT19937")
    _check(
        isinstance(keys, list)
        and len(keys) == 624
        and all(_is_int(k) and 0 <= k < 2**32 for k in keys),
        "numpy keys are not 624 32-bit words",
    )
    _check(_is_int(n.get("pos")) and 0 <= n["pos"] <= 624, "numpy pos")
    _check(_is_int(n.get("has_gauss")), "numpy has_gauss")
    _check(isinstance(n.get("cached_gaussian"), int | float), "numpy cached_gaussian")


def _check_b64(s: object, nbytes: int | None, what: str) -> None:
    _check(isinstance(s, str), f"{what} is not a string")
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptCheckpointError(f"host RNG state: {what} is not base64") from None
    _check(nbytes is None or len(raw) == nbytes, f"{what} has the wrong length")


def validate(states: object) -> dict:
    """Check the shape and types of states from :func:`capture` before restoring them.

    Raises:
        CorruptCheckpointError: a part is missing its fields or has the wrong type/size.
    """
    _check(isinstance(states, dict), "not an object")
    if "python" in states:
        _check_python(states["python"])
    if "numpy" in states:
        _check_numpy(states["numpy"])
    if "torch_cpu" in states:
        _check_b64(states["torch_cpu"], torch.get_rng_state().numel(), "torch_cpu")
    if "cuda" in states:
        cuda = states["cuda"]
        _check(isinstance(cuda, list), "cuda is not a list")
        for s in cuda:  # checked here: restore sets the CUDA generators last
            _check_b64(s, CUDA_STATE_BYTES, "cuda")
    _try_on_fresh_generators(states)
    return states


def _try_on_fresh_generators(states: dict) -> None:
    """Set each state on a generator of its own, never the process's: a state of the
    right shape can still be refused (an unknown Python version, an all-zero Mersenne
    Twister, a ``has_gauss`` past C long), and :func:`restore` must not meet that after
    it set the generators before it (a resume that half-applied and then crashed)."""
    try:
        if "python" in states:
            random.Random().setstate(_python_state(states["python"]))
        if "numpy" in states:
            import numpy as np

            np.random.RandomState().set_state(_numpy_state(states["numpy"]))
        if "torch_cpu" in states:
            torch.Generator().set_state(_unb64(states["torch_cpu"]))
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise CorruptCheckpointError(f"host RNG state refused by its generator: {e}") from None
    except ImportError:
        pass


def for_rank(attributes: dict, rank: int) -> dict | None:
    """The validated host RNG states a checkpoint recorded for ``rank`` (``None``: none).

    Raises:
        CorruptCheckpointError: the recorded states are malformed.
    """
    recorded = attributes.get("host_rng") or {}
    _check(isinstance(recorded, dict), "'host_rng' is not an object")
    states = recorded.get(str(rank))
    return None if states is None else validate(states)


class Mark:
    """Python's and torch's global generators as they stand, kept raw (~8 us, where
    :func:`capture`'s JSON-ready copy takes ~110 us): the training loop marks them at every
    step boundary and puts them back before an emergency save, whose :func:`capture` then
    records the generators of the state it saves, not those a failed step and its batch
    had advanced (a user's ``torch.nn.Dropout`` resumed differently from an emergency
    save). NumPy's global generator is not marked: reading it costs ~33 us a step."""

    def __init__(self) -> None:
        self.python = random.getstate()
        self.torch_cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def put_back(self) -> None:
        """Set the generators to what they were at the mark."""
        random.setstate(self.python)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
