"""Episodes of a Minari dataset in any data format minari writes, as minari's ``EpisodeData``.

Minari's ``hdf5`` datasets are read by minari's own reader.  Its ``arrow`` (and ``parquet``)
reader in minari 0.5.4 cannot read the infos its own writer (``create_dataset_from_buffers(...,
data_format="arrow")``) writes: a per-step scalar info is stored with an empty ``shape``
metadata that its decoder parses as ``int(b"")``, and a nested info dict is a struct column it
does not descend into.  So episodes of those formats are read here with pyarrow, one episode
folder at a time, observations and actions decoded by minari's own space decoder, infos by
:func:`decode_infos`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trajstore._optional import missing
from trajstore.errors import DamagedStoreError

__all__ = ["iterate_episodes", "decode_infos"]


def iterate_episodes(ds: Any, where: str) -> Iterator[Any]:
    """The episodes of the MinariDataset ``ds`` in its order (``ds.episode_indices``), one at a
    time: minari's own iterator for hdf5, :func:`_arrow_episodes` for arrow and parquet."""
    if getattr(ds.storage, "FORMAT", None) in ("arrow", "parquet"):
        return _arrow_episodes(ds, where)
    return iter(ds.iterate_episodes())


def _arrow_episodes(ds: Any, where: str) -> Iterator[Any]:
    """Minari's ``ArrowStorage.get_episodes`` with :func:`decode_infos` for the infos: each episode
    is the folder ``<data>/<id>`` of one record batch whose columns hold T+1 rows (actions,
    rewards, terminations and truncations padded by one)."""
    try:
        import pyarrow.dataset as pads  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise missing("pyarrow", f"{where}: Minari's arrow data format") from None
    from minari.dataset._storages.arrow_storage import _decode_space  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from minari.dataset.episode_data import EpisodeData  # type: ignore[import-untyped,import-not-found,unused-ignore]

    st = ds.storage
    jpeg = bool(getattr(st, "_jpeg_encoding", True))
    for ep_id in np.asarray(ds.episode_indices).tolist():
        table = pads.dataset(f"{st.data_path}/{int(ep_id)}", format=st.FORMAT,
                             ignore_prefixes=["_", ".", "metadata.json"]).to_table()
        steps = table.num_rows - 1
        if steps < 0:
            raise DamagedStoreError(f"{where}: episode {ep_id} holds no rows; expected T+1 (observations)")
        yield EpisodeData(
            id=int(ep_id),
            observations=_decode_space(st.observation_space, table["observations"].combine_chunks(),
                                       jpeg_encoding=jpeg),
            actions=_decode_space(st.action_space, table["actions"].combine_chunks()[:-1], jpeg_encoding=jpeg),
            rewards=np.asarray(table["rewards"])[:-1],
            terminations=np.asarray(table["terminations"])[:-1],
            truncations=np.asarray(table["truncations"])[:-1],
            infos=(decode_infos(table["infos"].combine_chunks(), f"{where}: episode {ep_id}: infos")
                   if "infos" in table.column_names else {}))


def decode_infos(values: Any, where: str) -> dict[str, Any]:
    """Minari's arrow encoding of an infos dict (a struct column, one row per observation) as the
    dict of arrays it was written from: a fixed-size-list field is an array of shape
    ``(rows, *shape)`` (``shape`` from the field's metadata, empty for a scalar per row), a struct
    field a nested dict, any other field its values as numpy.

    Raises
    ------
    DamagedStoreError
        A field whose ``shape`` metadata is not integers or does not match its list size.
    """
    import pyarrow as pa  # type: ignore[import-untyped,import-not-found,unused-ignore]

    out: dict[str, Any] = {}
    for i, field in enumerate(values.type):
        col = values.field(i)
        if pa.types.is_struct(field.type):
            out[field.name] = decode_infos(col, f"{where}/{field.name}")
        elif pa.types.is_fixed_size_list(field.type):
            text = (field.metadata or {}).get(b"shape", b"")
            try:
                shape = tuple(int(d) for d in text.split(b",") if d.strip())
            except ValueError:
                raise DamagedStoreError(f"{where}/{field.name}: shape metadata {text[:40]!r}; expected integers "
                                        "separated by commas") from None
            size = field.type.list_size
            if int(np.prod(shape, dtype=np.int64)) != size:
                raise DamagedStoreError(f"{where}/{field.name}: shape {shape} does not hold the {size} values of "
                                        "each row")
            out[field.name] = np.asarray(col.flatten().to_numpy(zero_copy_only=False)).reshape(len(col), *shape)
        else:
            out[field.name] = np.asarray(col.to_numpy(zero_copy_only=False))
    return out
