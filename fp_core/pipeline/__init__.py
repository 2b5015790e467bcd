"""AsyncCheckpointer: saves in the background, the fence, and the writer in a process of its own."""
