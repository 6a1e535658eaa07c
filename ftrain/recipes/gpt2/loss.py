"""The language-model loss of the GPT-2 recipe."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from torch.nn import functional as F

__all__ = ["lm_loss"]


def lm_loss(
    model: Callable[[torch.Tensor], torch.Tensor], batch: TensorDictBase
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross entropy over every position of the batch.

    Args:
        model: maps token ids ``[B, T]`` to logits ``[B, T, V]`` (a :class:`GPT`, or the
            step's ``functional_call`` wrapper around one).
        batch: a TensorDict with ``x`` (inputs) and ``y`` (targets, ``x`` shifted left by
            one), both int64 ``[B, T]``.

    Returns:
        ``(loss, {"tokens": n})``: the scalar float32 loss and the number of target
        tokens as an int64 scalar tensor (for tokens/s).

    Raises:
        KeyError: if ``batch`` lacks ``x`` or ``y``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.recipes.gpt2 import GPT, GPTConfig
        >>> model = GPT(GPTConfig.tiny(), generator=torch.Generator().manual_seed(0)).eval()
        >>> x = torch.zeros(2, 8, dtype=torch.long)
        >>> loss, aux = lm_loss(model, TensorDict(x=x, y=x, batch_size=[2]))
        >>> int(aux["tokens"])
        16
    """
    x, y = batch["x"], batch["y"]
    logits = model(x)
    # float32 for the softmax: under bf16/fp16 autocast a low-precision log-sum-exp over
    # the vocabulary loses most of the loss's digits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    return loss, {"tokens": torch.tensor(y.numel(), dtype=torch.int64, device=y.device)}
