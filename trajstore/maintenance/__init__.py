"""Maintenance: verify, repair and summarise stores (what the ``trajstore`` CLI runs).

Reads stores through :mod:`trajstore.core`; never imported by the layers below.
"""
