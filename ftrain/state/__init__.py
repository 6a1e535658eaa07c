"""The immutable training state and pytree helpers."""

from ftrain.state.init import (
    STATE_KEYS,
    check_usable,
    init_state,
    is_donated,
    is_pinned,
    mark_donated,
    pin,
    place,
    unpin,
)
from ftrain.state.load import load_params
from ftrain.state.tree import (
    cast,
    count_params,
    first_difference,
    flatten,
    map_leaves,
    path_str,
    replace,
    tree_equal,
    unflatten,
)

__all__ = [
    "STATE_KEYS",
    "cast",
    "check_usable",
    "count_params",
    "first_difference",
    "flatten",
    "init_state",
    "is_donated",
    "is_pinned",
    "load_params",
    "map_leaves",
    "mark_donated",
    "path_str",
    "pin",
    "place",
    "replace",
    "tree_equal",
    "unflatten",
    "unpin",
]
