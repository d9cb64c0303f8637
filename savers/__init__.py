"""Built-in checkpoint savers, one module per format (registered as ``pgconvert.savers``)."""
