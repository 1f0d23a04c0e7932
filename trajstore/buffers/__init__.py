"""Buffers: the public ``ReplayBuffer`` / ``TrajectoryReplayBuffer``, their views and backends.

Built on :mod:`trajstore.core` and :mod:`trajstore.sampling`; integrations build on them.
"""
