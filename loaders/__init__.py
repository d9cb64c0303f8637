"""Built-in checkpoint loaders, one module per format (registered as ``pgconvert.loaders``)."""
