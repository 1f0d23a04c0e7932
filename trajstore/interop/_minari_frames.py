"""Minari's JPEG-encoded image observations as their stored bytes (issue 31).

Minari 0.5 writes image-space observations (a uint8 ``Box`` of at least 32x32, bounds 0..255:
``minari.dataset.minari_storage.is_image_space``) JPEG-encoded by default (``jpeg_encoding``,
Pillow's ``Image.save(format="JPEG")``: quality 75), one JPEG per observation: an HDF5
variable-length uint8 dataset per episode, or an Arrow binary column.  An import whose
destination field is a JPEG field at that quality keeps those bytes (:data:`MINARI_JPEG`):
:class:`MinariFrames` reads them (the HDF5 file through the foreign gate, opened once), and the
import decodes them with the field's own codec (the rows it writes are what readers will decode)
and hands the bytes to the field (:meth:`ImageField.frames_as_encoded
<trajstore.storage.fields.image.ImageField.frames_as_encoded>`), so they are never encoded again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.errors import DamagedStoreError
from trajstore.interop.foreign_gate import h5py_module, open_hdf5
from trajstore.storage.fields.image import ImageField

__all__ = ["MINARI_JPEG", "MinariFrames", "jpeg_leaves", "passes_through"]

#: The compressor that keeps Minari's JPEG frames as they are (Pillow's default quality).
MINARI_JPEG = "jpeg:75"


def _is_image(space: Any) -> bool:
    """minari 0.5.4's ``is_image_space``, restated (what its writer JPEG-encodes)."""
    return (isinstance(space, Box) and len(space.shape) in (2, 3) and space.shape[0] >= 32 and space.shape[1] >= 32
            and space.dtype == np.uint8 and bool(np.all(space.low == 0)) and bool(np.all(space.high == 255)))


def jpeg_leaves(ds: Any) -> list[tuple[str, ...]]:
    """Key paths (``()``: the observation space itself) of the observation leaves that the dataset
    ``ds`` (a MinariDataset) stores JPEG-encoded."""
    if not bool(getattr(ds.storage, "jpeg_encoding", True)):  # (minari 0.5's default; older ones had no choice)
        return []
    out: list[tuple[str, ...]] = []
    level: list[tuple[tuple[str, ...], Any]] = [((), ds.observation_space)]
    while level:
        nxt = []
        for path, sp in level:
            if isinstance(sp, Dict):
                nxt += [((*path, k), v) for k, v in sp.spaces.items()]
            elif _is_image(sp):
                out.append(path)
        level = nxt
    return out


def passes_through(field: Any) -> bool:
    """Whether the destination ``field`` stores Minari's JPEG bytes as they are: a JPEG image
    field of :data:`MINARI_JPEG`'s quality holding each frame as one image."""
    return (isinstance(field, ImageField) and field.codec.format == "jpeg" and field.codec.level == 75
            and field.codec.planes is None)


class MinariFrames:
    """The stored JPEG bytes of observation leaves, episode by episode (a context manager)."""

    def __init__(self, ds: Any, where: str) -> None:
        self.ds, self.where = ds, where
        self.format = getattr(ds.storage, "FORMAT", "hdf5")
        self._stack = contextlib.ExitStack()
        self._h5: Any = None

    def __enter__(self) -> MinariFrames:
        if self.format == "hdf5":
            data = str(self.ds.storage.data_path)
            self._h5 = self._stack.enter_context(open_hdf5(h5py_module("import_minari"), "main_data.hdf5",
                                                           "import_minari", below=data))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def episode(self, ep_id: int, path: tuple[str, ...], rows: int) -> list[bytes]:
        """The ``rows`` (T+1) JPEG frames of leaf ``path`` of episode ``ep_id``.

        Raises DamagedStoreError when they are not there as minari writes them."""
        what = f"{self.where}: episode {ep_id}: observations{''.join('/' + k for k in path)}"
        try:
            blobs = list(self._read(ep_id, path))
        except DamagedStoreError:
            raise
        except Exception as e:  # noqa: BLE001  # h5py and pyarrow raise many kinds for damaged data
            raise DamagedStoreError(f"import_minari: {what}: the JPEG frames cannot be read ({type(e).__name__}: "
                                    f"{e})") from None
        if len(blobs) != rows:
            raise DamagedStoreError(f"import_minari: {what}: {len(blobs)} JPEG frames; expected {rows}")
        return blobs

    def _read(self, ep_id: int, path: tuple[str, ...]) -> Iterator[bytes]:
        if self._h5 is not None:
            node = self._h5[f"episode_{int(ep_id)}"]["observations"]
            for k in path:
                node = node[k]
            if node.dtype.kind != "O":
                raise DamagedStoreError(f"dtype {node.dtype}; expected variable-length bytes")
            for a in node[()]:
                yield np.asarray(a, np.uint8).tobytes()
            return
        import pyarrow.dataset as pads  # type: ignore[import-untyped,import-not-found,unused-ignore]

        st = self.ds.storage
        col = pads.dataset(f"{st.data_path}/{int(ep_id)}", format=st.FORMAT,
                           ignore_prefixes=["_", ".", "metadata.json"]).to_table(columns=["observations"])
        values = col["observations"].combine_chunks()
        for k in path:
            values = values.field(k)
        for v in values:
            b = v.as_py()
            if not isinstance(b, bytes):
                raise DamagedStoreError(f"a {type(b).__name__} value; expected JPEG bytes")
            yield b
