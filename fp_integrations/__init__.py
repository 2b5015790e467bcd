"""Framework adapters for FastPersist: framework events -> ``fp_core`` calls.

* ``fp_integrations.lightning``: ``FastPersistIO`` (a Lightning ``CheckpointIO`` plugin) and
  ``FastPersistCallback``, for the ``lightning`` package; ``PLFastPersistIO`` and
  ``PLFastPersistCallback`` for the ``pytorch_lightning`` package.

Submodules are imported on demand, so importing this package needs no framework.
"""
