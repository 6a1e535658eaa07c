"""Checks of a restored tree against what the caller asked for (``only=``, ``target=``)."""

from __future__ import annotations

from tensordict import TensorDictBase

from ftrain.ckpt.store import groups_and_arrays

__all__ = ["TargetMismatchError", "check_only", "match_target"]


def check_only(manifest: dict, only: tuple[str, ...] | None) -> None:
    if only is None:
        return
    names = set(manifest["arrays"]) | set(manifest["groups"])
    top = sorted({n.split("/")[0] for n in names if n})
    if not only:  # an empty selection restored an empty tree
        raise ValueError(
            f"only={only!r} names no key; pass only=None for everything, or key paths among "
            f"the top-level keys {top}"
        )
    for p in only:  # "" is the root group's name, but selects no key (it restored nothing)
        if not p or not any(n == p or n.startswith(p + "/") for n in names):
            raise ValueError(f"only={p!r} matches nothing in the checkpoint; top-level keys: {top}")


_SHOWN = 10  # differences a mismatch lists (a precision change made ~400 lines)


class TargetMismatchError(ValueError):
    """A checkpoint's arrays do not fit the target's; ``differences`` lists them all, the
    message the first ten and a count of the rest."""

    def __init__(self, differences: list[str]) -> None:
        self.differences = list(differences)
        shown = differences[:_SHOWN]
        more = len(differences) - len(shown)
        super().__init__(
            f"checkpoint does not match the target ({len(differences)} differences):\n  "
            + "\n  ".join(shown)
            + (f"\n  and {more} more" if more else "")
        )


def _rooted_below(only, got: set, want: dict, target: TensorDictBase) -> list[str]:
    """``restore(only="params", target=state["params"])``: a target rooted at the selected
    subtree instead of at the state. Said first, since every key then differs."""
    if only is None or want:
        return []
    inner = set(groups_and_arrays(target)[1])
    for p in only:
        if inner and {f"{p}/{k}" for k in inner} <= got:
            return [
                f"the target is rooted at {p!r}, not at the state: pass the state's "
                "template (target=state; only= picks what is read)"
            ]
    return []


def match_target(
    td: TensorDictBase, target: TensorDictBase, only: tuple[str, ...] | None
) -> TensorDictBase:
    """Validate ``td`` against ``target`` (all differences at once) and move to its devices
    (a leaf whose target is on the meta device stays on the CPU: meta holds no values)."""
    groups_c, got = groups_and_arrays(td)
    groups_t, want = groups_and_arrays(target)
    if only is not None:
        sel = lambda k: any(k == p or k.startswith(p + "/") for p in only)  # noqa: E731
        want = {k: v for k, v in want.items() if sel(k)}
        groups_t = [g for g in groups_t if sel(g) or not g]
        groups_c = [g for g in groups_c if sel(g) or not g]
    diffs = [f"missing in checkpoint: {k}" for k in sorted(set(want) - set(got))]
    diffs += [f"not in target: {k}" for k in sorted(set(got) - set(want))]
    diffs += [f"group missing in checkpoint: {g}" for g in sorted(set(groups_t) - set(groups_c))]
    diffs += [f"group not in target: {g}" for g in sorted(set(groups_c) - set(groups_t))]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            diffs.append(f"shape of {k}: checkpoint {tuple(a.shape)}, target {tuple(b.shape)}")
        if a.dtype != b.dtype:
            diffs.append(f"dtype of {k}: checkpoint {a.dtype}, target {b.dtype}")
    if diffs:
        raise TargetMismatchError(_rooted_below(only, set(got), want, target) + diffs)
    for k, t in want.items():
        if t.device != got[k].device and not t.is_meta:  # a meta template: shapes only
            td[tuple(k.split("/"))] = got[k].to(t.device)
    return td
