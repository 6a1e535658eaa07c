"""The ``zarr.json`` documents of one step, with the hierarchy consolidated into the root.

The root group's document carries zarr-python's inline consolidated metadata (every group
and array document of the step, keyed by its path, exactly as
``zarr.consolidate_metadata`` writes it; ``"must_understand": false``, so a v3 reader that
does not know the extension ignores it). A plain ``zarr.open_group(step, mode="r")`` then
walks the whole step from that one document instead of listing directories, so the
non-Zarr ``manifest.json`` and ``COMMITTED`` beside it are never tried as nodes and no
"not recognized as a component of a Zarr hierarchy" warning is raised. It also makes a
plain reader open a step with one read instead of one per node. Every document is still
written in its own place too; ftrain itself never reads the consolidated copy (restore
trusts the manifest, ``verify`` checks each document against its checksum).
"""

from __future__ import annotations

from ftrain.ckpt.format import ArraySpec, array_zarr_json, group_zarr_json

__all__ = ["step_documents"]

# what zarr-python writes for a nested group inside consolidated metadata
_EMPTY = {"kind": "inline", "must_understand": False, "metadata": {}}


def step_documents(groups: list[str], specs: dict[str, ArraySpec], attributes: dict) -> dict:
    """``{relative path of the zarr.json: document}`` for every node of a step.

    Args:
        groups: the group paths (``""`` = root) of the tree.
        specs: the planned arrays by key.
        attributes: the root group's attributes.

    Returns:
        The documents; the root's carries the consolidated metadata of all the others.

    Example:
        >>> sorted(step_documents(["", "params"], {}, {"step": 1}))
        ['params/zarr.json', 'zarr.json']
    """
    nodes: dict[str, dict] = {g: group_zarr_json() for g in groups if g}
    nodes |= {s.key: array_zarr_json(s) for s in specs.values()}
    docs = {f"{path}/zarr.json": doc for path, doc in nodes.items()}
    inline = {
        path: doc | {"consolidated_metadata": _EMPTY} if doc["node_type"] == "group" else doc
        for path, doc in nodes.items()
    }
    root = group_zarr_json(attributes)
    root["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": inline}
    return {"zarr.json": root} | docs
