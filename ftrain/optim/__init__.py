"""ftrain.optim: optax-style optimizers over TensorDict pytrees.

An optimizer is a :class:`GradientTransformation` ``(init, update, lr)`` of pure functions::

    import torch
    from tensordict import TensorDict
    from ftrain import optim

    tx = optim.adamw(optim.schedule.warmup_cosine(6e-4, 100, 5000, end=6e-5),
                     weight_decay=0.1, mask=optim.masks.ndim_at_least(2))
    params = TensorDict.from_module(model).detach()
    opt_state = tx.init(params)
    grads = ...                                   # a TensorDict shaped like params
    updates, opt_state = tx.update(grads, opt_state, params)
    params = params + updates
    tx.lr(opt_state)                              # the next update's learning rate

See ``docs/optim.md`` for the state layouts and the purity/donation rules.
"""

from ftrain.optim import masks, schedule
from ftrain.optim.alias import adam, adamw, sgd
from ftrain.optim.base import (
    FlatUpdate,
    GradientTransformation,
    chain,
    flatten,
    make_transform,
    path_str,
    unflatten,
)
from ftrain.optim.schedule import Schedule
from ftrain.optim.transform import (
    add_decayed_weights,
    clip_by_global_norm,
    global_norm,
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
    "flatten",
    "global_norm",
    "make_transform",
    "masks",
    "path_str",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "schedule",
    "sgd",
    "trace",
    "unflatten",
]
