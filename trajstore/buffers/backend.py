"""Output backends: what reads return (numpy arrays, or torch tensors on a device)."""

from __future__ import annotations

from typing import Any

import numpy as np

from trajstore._optional import missing
from trajstore.errors import BadOptionError

__all__ = ["Backend"]


class Backend:
    """Converts freshly gathered numpy arrays (always private copies) to the chosen backend.

    Parameters
    ----------
    name : {"numpy", "torch"}
    device : str or torch.device, optional
        Torch device of returned tensors (default CPU); must be None for numpy.
    """

    def __init__(self, name: str = "numpy", device: Any = None) -> None:
        if name not in ("numpy", "torch"):
            raise BadOptionError(f"backend must be 'numpy' or 'torch'; got {name!r}")
        if name == "numpy" and device is not None:
            raise BadOptionError(f"device={device!r} needs backend='torch'")
        self.name = name
        self.device = device
        self._torch: Any = None
        if name == "torch":
            try:
                import torch
            except ImportError:
                raise missing("torch", "backend='torch'") from None
            self._torch = torch
            self.device = torch.device(device) if device is not None else torch.device("cpu")

    def out(self, arr: np.ndarray) -> Any:
        """``arr`` in this backend (no copy for numpy: the gather already copied)."""
        if self._torch is None:
            return arr
        # np.ascontiguousarray would turn a 0-d array into shape (1,); np.require keeps it.
        t = self._torch.from_numpy(np.require(arr, requirements="C"))
        return t if self.device.type == "cpu" else t.to(self.device)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, device={self.device!r})"
