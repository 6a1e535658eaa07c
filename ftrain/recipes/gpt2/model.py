"""GPT-2 in one readable file (after nanoGPT's ``model.py``), with keyed randomness.

Architecture: token + position embeddings -> ``n_layer`` pre-LN blocks (causal
self-attention, GELU MLP) -> final LayerNorm -> an output layer whose weight is *tied* to
the token embedding, as in GPT-2.

What differs from nanoGPT, and why:

- **No global RNG, ever.** Dropout is :class:`ftrain.nn.Dropout`, which draws from the
  generator that ftrain's step derives from the state's key, so a resumed run repeats
  the same masks. Initialisation takes an explicit :class:`torch.Generator`; the layers
  are built on the ``meta`` device first, so torch's default ``reset_parameters`` (which
  draws from the global generator) never runs.
- **No attention-weight dropout.** ``scaled_dot_product_attention(dropout_p=...)`` draws
  from the global generator and cannot take ours, so SDPA always runs with
  ``dropout_p=0`` and regularisation comes from keyed dropout on the attention output
  (before it joins the residual stream), on the MLP output, and on the embeddings.
- **Tied by structure, not by alias.** The output layer multiplies by
  ``transformer.wte.weight`` directly (no ``lm_head.weight`` alias), so the params pytree
  holds the tied weight once and an out-of-place update cannot untie it (see :class:`GPT`).

Sizes (``bias=True``; tied weights counted once; position embeddings included):

=============================================  ===========  ===========
preset                                          vocab 256    vocab 50304
=============================================  ===========  ===========
``GPTConfig.gpt2()``  12 layers, 12 heads, 768   86,039,040  124,475,904
``GPTConfig.tiny()``   4 layers,  4 heads,  64      220,544            -
=============================================  ===========  ===========

ftrain's corpus is byte-level, so the recipe's vocabulary is 256 and GPT-2 small has
~86M parameters instead of the familiar 124M (the 50257-token BPE vocabulary, padded to
50304, adds 38.4M). Pass ``vocab_size=50304`` to get the original size.

Example:
    >>> import torch
    >>> from ftrain.recipes.gpt2 import GPT, GPTConfig
    >>> model = GPT(GPTConfig.tiny(), generator=torch.Generator().manual_seed(0))
    >>> model.eval()(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ftrain.nn import Dropout

__all__ = ["GPT", "GPTConfig", "init_weights"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model.

    Args:
        block_size: maximum context length (number of position embeddings).
        vocab_size: number of token ids; 256 for ftrain's byte-level tokenizer.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: keyed dropout probability in ``[0, 1)`` (embeddings, attention output,
            MLP output). GPT-2 used 0.1; 0.0 turns dropout off.
        bias: biases in Linear layers and LayerNorms (GPT-2: True).

    Raises:
        ValueError: for a non-positive size, ``n_embd`` not divisible by ``n_head``, or
            ``dropout`` outside ``[0, 1)``.
    """

    block_size: int = 1024
    vocab_size: int = 256
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {name}={value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd must be divisible by n_head, got n_embd={self.n_embd} and "
                f"n_head={self.n_head}; pick n_head from the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got dropout={self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be a bool, got bias={self.bias!r}")

    @classmethod
    def gpt2(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (12 layers, 12 heads, 768 wide, context 1024, dropout 0.1).

        The vocabulary defaults to ftrain's 256 bytes (~86M parameters); pass
        ``vocab_size=50304`` (GPT-2's 50257 padded up to a multiple of 64 for efficient
        matmuls, as nanoGPT does) for the original 124M.
        """
        base = cls(block_size=1024, vocab_size=256, n_layer=12, n_head=12, n_embd=768)
        return dataclasses.replace(base, **{"dropout": 0.1, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """A ~220k-parameter GPT for smoke runs and tests (4 layers, 4 heads, 64 wide, context 64).

        Dropout stays on (0.1) so that smoke runs exercise the keyed-dropout path.
        """
        base = cls(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=64, dropout=0.1)
        return dataclasses.replace(base, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        # q, k and v for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection back into the residual stream (init scaled, see init_weights)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # dropout_p=0: SDPA's dropout would draw from the global generator (see module doc)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 used the tanh approximation of GELU; keep it so GPT-2 weights behave alike
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: normalise *before* each sub-layer, so the residual stream is an
    un-normalised sum; this is what makes deep GPT-2s train stably without warm tricks."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 language model: ``forward(idx) -> logits``.

    Args:
        config: the model's shape.
        generator: the generator that initialises the weights (e.g.
            ``ftrain.rng.generator(fold_in(key, ftrain.rng.STREAM_INIT))``). Required
            unless ``device="meta"``. Weights are drawn on the generator's device and
            copied, so one key gives the same weights on every device.
        device: where the parameters live (default CPU). ``"meta"`` builds a shape-only
            model (no memory, no init), e.g. to count parameters of a large config.

    Raises:
        ValueError: if ``generator`` is missing for a real device.

    Parameters are named as in nanoGPT/HF GPT-2 (``transformer.h.0.attn.c_attn.weight``,
    ...). The output layer (``lm_head``) is *tied* to the token embedding (Press & Wolf
    2017: reading a token and predicting it share one matrix), and the tie is structural:
    ``forward`` multiplies by ``transformer.wte.weight`` itself instead of aliasing it as
    ``lm_head.weight`` the way nanoGPT does. An alias would show up twice in
    ``TensorDict.from_module`` and ``state_dict()`` (the pytree ftrain trains and saves),
    and any out-of-place update of that pytree would silently untie the two copies. So
    there is exactly one leaf, its gradient is the sum of both uses, and ``params``,
    ``state_dict()`` and checkpoints all hold it once.

    Example:
        >>> import torch
        >>> model = GPT(GPTConfig.gpt2(), device="meta")
        >>> model.num_params()
        86039040
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        generator: torch.Generator | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        device = torch.device("cpu" if device is None else device)
        if generator is None and device.type != "meta":
            raise ValueError(
                "GPT(...) needs an explicit generator to initialise its weights (ftrain never "
                "draws from torch's global RNG), e.g. GPT(config, generator="
                "ftrain.rng.generator(ftrain.rng.key(0))); pass device='meta' for a "
                "shape-only model"
            )
        self.config = config
        # Build on "meta" so torch's default init (global RNG) never runs; materialise
        # below and initialise from `generator`.
        with torch.device("meta"):
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config.vocab_size, config.n_embd),
                    wpe=nn.Embedding(config.block_size, config.n_embd),
                    drop=Dropout(config.dropout),
                    h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                    ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
                )
            )
        if device.type != "meta":
            self.to_empty(device=device)
        if generator is not None and device.type != "meta":
            init_weights(self, generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``idx`` ``[B, T]`` (int64).

        Raises:
            ValueError: if ``T`` exceeds ``config.block_size``.
        """
        T = idx.shape[-1]
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size={self.config.block_size}; "
                "crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        # lm_head, tied to the token embedding: see the class docstring
        return F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters, tied weights counted once.

        Args:
            non_embedding: leave out the position embeddings (nanoGPT's convention for
                scaling laws; the token embedding stays, as it is also the output layer).
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n


@torch.no_grad()
def init_weights(model: GPT, generator: torch.Generator) -> None:
    """(Re-)initialise ``model`` in place as GPT-2 does, drawing only from ``generator``.

    Linear and embedding weights ~ N(0, 0.02); the projections that write into the
    residual stream (``*.c_proj.weight``) ~ N(0, 0.02 / sqrt(2 * n_layer)), because each
    of the 2 * n_layer residual additions would otherwise grow the stream's variance;
    biases 0; LayerNorm scale 1. Parameters are visited in ``named_parameters()`` order
    (tied weights once), so the result is a pure function of the generator's state.

    Args:
        model: a :class:`GPT` on a real (non-meta) device.
        generator: the only source of randomness; its state advances.

    Example:
        >>> m = GPT(GPTConfig.tiny(), generator=torch.Generator().manual_seed(0))
        >>> init_weights(m, torch.Generator().manual_seed(1))
    """
    resid_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln_" in name:  # ln_1, ln_2, ln_f scales
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith("c_proj.weight") else 0.02
            # draw in float32 on the generator's device: same key -> same weights anywhere
            w = torch.empty(p.shape, dtype=torch.float32, device=generator.device)
            p.copy_(w.normal_(0.0, std, generator=generator))
