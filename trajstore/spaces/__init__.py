"""Spaces layer: gymnasium spaces as stored arrays (leaves, JSON encoding, value conversion).

The lowest layer beside ``trajstore.errors``: it knows nothing of stores.
"""

from trajstore.spaces.codec import space_from_json, space_to_json
from trajstore.spaces.leaves import Leaf, flatdim, leaves, subspace
from trajstore.spaces.values import ValuePlan

__all__ = ["Leaf", "ValuePlan", "flatdim", "leaves", "space_from_json", "space_to_json", "subspace"]
