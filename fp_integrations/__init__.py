"""Framework adapters for FastPersist: framework events -> ``fp_core`` calls.

* ``fp_integrations.lightning``: ``FastPersistIO`` (a Lightning ``CheckpointIO`` plugin),
  ``FastPersistCallback`` and ``FastPersistModelCheckpoint``, for the ``lightning`` package;
  ``PLFastPersistIO``, ``PLFastPersistCallback`` and ``PLFastPersistModelCheckpoint`` for the
  ``pytorch_lightning`` package. Their code lives in ``lightning_io`` (the plugin),
  ``lightning_callback``, ``lightning_checkpoint`` and ``lightning_sharded`` (the sharded
  strategies routed through the plugin).
* ``fp_integrations.hf``: ``FastPersistCallback`` for the Hugging Face ``Trainer``,
  ``verify_checkpoint_dir``, ``remote_checkpoints`` and ``download_checkpoint``. Their code
  lives in ``hf_callback`` (the callback and its save path), ``hf_resume``, ``hf_remote``,
  ``hf_fsdp`` and ``hf_common``.

Import from ``fp_integrations.lightning`` and ``fp_integrations.hf``; the other modules are
how they are built. Submodules are imported on demand, so importing this package needs no
framework.
"""
