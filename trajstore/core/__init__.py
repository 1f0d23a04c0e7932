"""Core engine: tables of fields, ring indexing, the commit protocol and a store's lifecycle.

Imports only :mod:`trajstore.storage`, :mod:`trajstore.spaces` and the base modules.
"""
