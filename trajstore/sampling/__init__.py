"""Sampling: uniform rows and sequence windows over a :class:`~trajstore.sampling.source.RowSource`.

Imports only :mod:`trajstore.core` and below; buffers hand themselves in as row sources.
"""
