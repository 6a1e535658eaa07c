"""ftrain.optim: optax-style optimizers over TensorDict pytrees.

An optimizer is a :class:`GradientTransformation` ``(init, update)`` of pure functions::

    import torch
    from tensordict import TensorDict
    from ftrain import optim

    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.schedule.warmup_cosine(6e-4, 100, 5000, end=6e-5),
                    weight_decay=0.1, mask=optim.masks.ndim_at_least(2)),
    )
    params = TensorDict.from_module(model).detach()
    opt_state = tx.init(params)
    grads = ...                                   # a TensorDict shaped like params
    updates, opt_state = tx.update(grads, opt_state, params)
    params = params + updates
    optim.tree_get(opt_state, "learning_rate")    # the next update's learning rate
    opt_state = optim.refresh_hyperparams(tx, restored)  # after a resume with a new schedule

Gradient processing (clipping, fp16 loss scaling, the cross-rank mean) is transforms too
(:mod:`ftrain.optim.processing`); parameter groups and frozen leaves are
``multi_transform`` and ``frozen`` (:mod:`ftrain.optim.partition`). See ``docs/optim.md`` for the state layouts.
"""

from ftrain.optim import masks, schedule
from ftrain.optim.alias import adam, adamw, sgd
from ftrain.optim.base import (
    FlatUpdate,
    GradientTransformation,
    chain,
    flatten,
    frozen_indices,
    make_transform,
    path_str,
    refresh_hyperparams,
    tree_get,
    unflatten,
)
from ftrain.optim.buffers import release_buffers
from ftrain.optim.partition import frozen, learning_rates, multi_transform
from ftrain.optim.processing import (
    clip_by_global_norm,
    clip_by_global_norm_torch,
    dynamic_loss_scale,
    global_norm,
    mean_across_ranks,
)
from ftrain.optim.schedule import Schedule
from ftrain.optim.transform import (
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "FlatUpdate",
    "GradientTransformation",
    "Schedule",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "clip_by_global_norm",
    "clip_by_global_norm_torch",
    "dynamic_loss_scale",
    "flatten",
    "frozen",
    "frozen_indices",
    "global_norm",
    "learning_rates",
    "make_transform",
    "masks",
    "mean_across_ranks",
    "multi_transform",
    "path_str",
    "refresh_hyperparams",
    "release_buffers",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "schedule",
    "sgd",
    "trace",
    "tree_get",
    "unflatten",
]
