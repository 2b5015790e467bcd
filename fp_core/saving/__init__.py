"""Save jobs and commits: a local file, temporary names, the rename, retention."""
