"""Optional dependencies, probed in one place.

trajstore's core needs numpy, zarr and gymnasium only. torch tensors are accepted wherever arrays
are (values, indices, ids) without importing torch: :func:`is_tensor` recognizes them by their
type's module, so a process that never imported torch never pays for it. :func:`missing` is the
:class:`~trajstore.errors.MissingDependencyError` to raise when a plain ``import`` of an optional
module fails, naming the pip extra that installs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trajstore.errors import MissingDependencyError

__all__ = ["EXTRAS", "is_tensor", "to_numpy", "missing"]

#: The pip extra (``pip install 'trajstore[<extra>]'``) that installs each optional module.
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "stable_baselines3": "sb3",
    "tqdm": "cli",
    "matplotlib": "plot",
    "s3fs": "s3",
    "dask": "dask",
    "h5py": "interop",
    "minari": "interop",
    "pyarrow": "interop",
    "xarray": "xarray",
    "ray": "ray",
    "av": "video",
    "torchrl": "torchrl",
    "tensordict": "torchrl",
}


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, decided without importing torch."""
    return type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "detach")


def to_numpy(x: Any) -> np.ndarray:
    """A torch tensor (detached, copied to the CPU) or anything array-like as a numpy array."""
    return x.detach().cpu().numpy() if is_tensor(x) else np.asarray(x)


def missing(module: str, what: str) -> MissingDependencyError:
    """The error for ``what`` (e.g. ``"trajstore.torch"``, ``"progress bars"``) when the optional
    ``module`` is not installed: it names the pip extra that installs it (and the torch pin, which
    matters: the extras pin one CPU build).  Callers import with a plain ``import`` statement (never
    by a name held in a variable) and raise this from the ``ImportError``."""
    top = module.split(".", 1)[0]
    extra = EXTRAS.get(top)
    hint = f"pip install 'trajstore[{extra}]'" if extra else f"pip install {top}"
    if top == "torch":
        hint += " (it pins torch==2.13.0)"
    return MissingDependencyError(f"{what} needs {top.replace('_', '-')}: {hint}")
