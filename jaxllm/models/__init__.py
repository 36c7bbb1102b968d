"""Model definitions, the architecture registry and the checkpoint loaders."""
