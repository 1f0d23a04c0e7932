"""Field engines: one zarr array of rows each, read and written by row ranges.

:mod:`.base` defines the :class:`~trajstore.storage.fields.base.Field` protocol both engines
implement, :mod:`.spec` a field's layout, :mod:`.layout` which engine a field gets,
:mod:`.mapped` raw chunks read through memory maps and :mod:`.chunked` compressed chunks.
"""
