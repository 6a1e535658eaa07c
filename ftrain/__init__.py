"""ftrain: a functional trainer on PyTorch with consistent, resumable Zarr v3 checkpoints.

The whole training state is one immutable TensorDict advanced by a pure step::

    import torch, ftrain

    model = torch.nn.Linear(3, 1)
    tx = ftrain.optim.adamw(1e-3, weight_decay=0.1)
    state = ftrain.init_state(model, tx, seed=0)
    step = ftrain.make_step(model, lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean(), tx)
    with ftrain.CheckpointManager("ckpts", save_policy=ftrain.ckpt.EveryNSteps(100)) as mgr:
        for batch in batches:
            state, metrics = step(state, batch)
            mgr.save(state, metrics={"loss": metrics["loss"]})

Modules: :mod:`ftrain.optim` (optax-style optimizers and schedules), :mod:`ftrain.rng`
(the key chain), :mod:`ftrain.data` (sources, elastic cursor, loader), :mod:`ftrain.ckpt`
(checkpoints), :mod:`ftrain.state` (tree helpers), :mod:`ftrain.nn` (keyed dropout),
:mod:`ftrain.lora` (LoRA adapters; freeze the rest with ``optim.multi_transform``)::

    ftrain.lora.apply_lora(model, rank=8, alpha=16, targets=["c_attn"], generator=g)
    tx = ftrain.optim.multi_transform(
        {"lora": ftrain.optim.adamw(1e-3), "frozen": ftrain.optim.frozen()},
        {"lora": ftrain.lora.is_adapter, "frozen": None},
    )

The command line: ``python -m ftrain +recipe=gpt2``; ``python -m ftrain.ckpt``;
``python -m ftrain.eval RUN``.
"""

# first, before anything opens a file: a closed stdin/stdout/stderr gets /dev/null, or the
# next file opened takes its number (torch's and C code's stderr went into the run lock)
from ftrain import _stdio  # noqa: F401  (reopens on import)

# isort: split
# before torch: `python -m ftrain` keeps a stop signal that comes while torch imports
from ftrain import _early_signals  # noqa: F401  (installs on import; the CLI takes them)

# isort: split
from ftrain import _early_env  # noqa: F401  (checks on import: torch's import reads it)

# isort: split
from ftrain import ckpt, data, lora, nn, optim, rng, state
from ftrain.ckpt import (
    AnyOf,
    BestN,
    CheckpointFormatError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptCheckpointError,
    EveryKSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    LatestN,
    YoungerThan,
)
from ftrain.data import Loader, init_cursor, val_batches
from ftrain.loop import LoopResult, train_loop
from ftrain.signals import StopFlag
from ftrain.state import (
    cast,
    count_params,
    first_difference,
    init_state,
    load_params,
    replace,
    tree_equal,
)
from ftrain.step import evaluate, make_eval_step, make_step

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointFormatError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "EveryKSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "LatestN",
    "Loader",
    "LoopResult",
    "StopFlag",
    "YoungerThan",
    "cast",
    "ckpt",
    "count_params",
    "data",
    "evaluate",
    "first_difference",
    "init_cursor",
    "init_state",
    "load_params",
    "lora",
    "make_eval_step",
    "make_step",
    "nn",
    "optim",
    "replace",
    "rng",
    "state",
    "train_loop",
    "tree_equal",
    "val_batches",
]
__version__ = "0.1.0"
