"""Our own model implementations and their loaders."""
