"""Running conversions: convert, batch plans, sharded runs, worker pools, the manifest, the destination directory, inspect and verify."""
