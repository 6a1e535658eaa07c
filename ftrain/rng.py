"""The RNG key chain: pure, counter-based keys in the style of JAX's PRNG keys.

A *key* is a 0-d ``torch.int64`` tensor holding 64 random bits. Keys are never
mutated: new keys are *derived* with :func:`fold_in` (mix an integer or a name
into a key) and :func:`split` (make ``n`` independent children). Randomness in a
step comes from a key turned into a local :class:`torch.Generator` by
:func:`generator`; library code never touches torch's global generator.

Construction
------------
All derivation runs on the host over Python integers, so a key chain is
identical on every device, platform and torch version. The mixing function is
the SplitMix64 finaliser (Steele, Lea & Flood 2014), a bijection on 64-bit words
with full avalanche. With ``m = mix64``::

    fold_in(k, d) = m(k + m(d XOR FOLD_DOMAIN))      (mod 2**64)
    split(k, n)[i] = m(k + m(i XOR SPLIT_DOMAIN))

For a fixed ``k`` each map is injective in ``d`` (composition of bijections),
so two integers folded into one key collide only if they are equal modulo 2**64 (``-1``
is ``2**64 - 1``, as JAX's ``uint32`` data wraps), and the two
domain constants keep ``split`` children apart from ``fold_in`` children.
Strings are folded in through their BLAKE2b-64 digest.

Per-step keys depend only on ``(base key, step, rank, stream)``, never on how
many keys were drawn before, so a resumed run draws exactly the keys the
uninterrupted run drew (see :func:`step_key`).
"""

from __future__ import annotations

import hashlib
import operator

import torch

__all__ = [
    "STREAM_DATA",
    "STREAM_DROPOUT",
    "STREAM_EVAL",
    "STREAM_INIT",
    "fold_in",
    "generator",
    "key",
    "key_data",
    "split",
    "step_key",
]

_MASK64 = (1 << 64) - 1
_FOLD_DOMAIN = 0x6A09E667F3BCC908
_SPLIT_DOMAIN = 0xBB67AE8584CAA73B
_GOLDEN = 0x9E3779B97F4A7C15

# Purposes of randomness; fold one into a step key to get that purpose's stream.
STREAM_DROPOUT = 1
STREAM_DATA = 2
STREAM_INIT = 3
STREAM_EVAL = 4


def _mix64(z: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit words with full avalanche."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _to_signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def _from_tensor(k: torch.Tensor) -> int:
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or k.dim() != 0:
        raise TypeError(
            f"expected an ftrain key (0-d torch.int64 tensor), got {k!r}; "
            "make one with ftrain.rng.key(seed)"
        )
    return int(k.item()) & _MASK64


def _data_word(data: int | str) -> int:
    if isinstance(data, str):
        return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")
    if isinstance(data, bool) or not isinstance(data, int):
        raise TypeError(f"fold_in takes an int or str, got {data!r} of type {type(data).__name__}")
    return data & _MASK64


def _make(u: int) -> torch.Tensor:
    return torch.tensor(_to_signed(u), dtype=torch.int64)


def key(seed: int) -> torch.Tensor:
    """Make a base key from an integer seed.

    Args:
        seed: any Python int (negative and > 64-bit values are reduced mod 2**64).

    Returns:
        A 0-d int64 tensor.

    Example:
        >>> k = key(0)
        >>> k.dtype, k.shape
        (torch.int64, torch.Size([]))
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return _make(_mix64(seed & _MASK64))


def key_data(k: torch.Tensor) -> int:
    """The key's 64 bits as an unsigned Python int (e.g. to seed a generator)."""
    return _from_tensor(k)


def fold_in(k: torch.Tensor, data: int | str) -> torch.Tensor:
    """Derive a new key by mixing ``data`` (an int or a name) into ``k``.

    Example:
        >>> k = key(0)
        >>> bool(fold_in(k, 1) != fold_in(k, 2))
        True
    """
    return _make(_mix64((_from_tensor(k) + _mix64(_data_word(data) ^ _FOLD_DOMAIN)) & _MASK64))


def split(k: torch.Tensor, n: int = 2) -> torch.Tensor:
    """Derive ``n`` independent child keys, returned as an int64 tensor of shape ``(n,)``.

    Example:
        >>> a, b = split(key(0))
        >>> bool(a != b)
        True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"split needs a non-negative int count, got n={n!r}")
    base = _from_tensor(k)
    words = [_to_signed(_mix64((base + _mix64(i ^ _SPLIT_DOMAIN)) & _MASK64)) for i in range(n)]
    return torch.tensor(words, dtype=torch.int64)


def step_key(base: torch.Tensor, step: int, stream: int | str, rank: int = 0) -> torch.Tensor:
    """The key of one purpose at one step on one rank: a pure function of its inputs.

    ``fold_in(fold_in(fold_in(base, step), rank), stream)`` — so recomputing a step
    from the same state draws the same randomness, whatever ran before.
    """
    return fold_in(fold_in(fold_in(base, _whole("step", step)), _whole("rank", rank)), stream)


def _whole(name: str, value) -> int:
    """An int or an integer tensor (``int(1.7)`` made step 1.7 draw step 1's keys)."""
    try:
        if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool:
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"step_key needs an integer {name}, got {name}={value!r}") from None


def generator(k: torch.Tensor, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh local ``torch.Generator`` on ``device`` seeded from key ``k``.

    Example:
        >>> g = generator(key(0))
        >>> torch.rand(2, generator=g).shape
        torch.Size([2])
    """
    g = torch.Generator(device=device)
    g.manual_seed(_from_tensor(k))
    return g
