"""Storage layer: bytes and arrays on disk or behind fsspec, with no notion of buffers.

Where a store lives (:mod:`.location`), path confinement (:mod:`.confined`), ``.zip`` stores
(:mod:`.zipstore`), the commit record and writer locks (:mod:`.head`, :mod:`.locks`), the on-disk
schema checks (:mod:`.schema`) and the field engines (:mod:`.fields`).  Imports only
``trajstore.errors``, ``trajstore._optional`` and :mod:`trajstore.spaces`.
"""
