"""Many ranks writing one checkpoint: collective saves, sharded state as one file or a DCP directory."""
