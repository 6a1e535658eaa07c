"""Randomness for model code without global RNG: a step-scoped generator and a keyed Dropout.

``torch.nn.Dropout`` draws from torch's *global* generator, so two runs only agree if
nobody else drew in between — the opposite of a key chain. ftrain's step sets a local
``torch.Generator`` (derived from the state's key, the step and the rank) for the
duration of the forward pass with :func:`use_generator`; :class:`Dropout` draws from
it. Outside a step (e.g. plain inference) there is no generator and Dropout in train
mode raises, rather than silently falling back to global RNG.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["Dropout", "current_generator", "use_generator"]

_GENERATOR: contextvars.ContextVar[torch.Generator | None] = contextvars.ContextVar(
    "ftrain_generator", default=None
)


@contextlib.contextmanager
def use_generator(g: torch.Generator | None) -> Iterator[torch.Generator | None]:
    """Make ``g`` the generator that ftrain-aware layers draw from inside the block.

    Example:
        >>> import ftrain
        >>> with use_generator(ftrain.rng.generator(ftrain.rng.key(0))):
        ...     y = Dropout(0.5)(torch.ones(4))
    """
    token = _GENERATOR.set(g)
    try:
        yield g
    finally:
        _GENERATOR.reset(token)


def current_generator() -> torch.Generator | None:
    """The generator set by the enclosing :func:`use_generator`, or ``None``."""
    return _GENERATOR.get()


class Dropout(nn.Module):
    """Inverted dropout that draws its mask from the step's key-derived generator.

    Args:
        p: probability of zeroing an element, in ``[0, 1)``.

    Raises:
        ValueError: for ``p`` outside ``[0, 1)``.
        RuntimeError: in training mode with ``p > 0`` outside :func:`use_generator`.
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout needs 0 <= p < 1, got p={p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        g = current_generator()
        if g is None:
            raise RuntimeError(
                "ftrain.nn.Dropout ran in training mode without a generator; call the model "
                "through ftrain's step (which derives one from the state's key) or wrap the "
                "call in ftrain.nn.use_generator(...), or call model.eval() for inference"
            )
        if g.device != x.device:
            raise RuntimeError(f"dropout generator is on {g.device} but the input is on {x.device}")
        keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(
            1.0 - self.p, generator=g
        )
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
