"""Test helpers: fixture writers, reference forwards, megatron-core and gloo scripts the tests run."""
