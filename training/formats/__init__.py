"""Checkpoint formats: one definition of each sharded layout, lazy readers, streaming writers, `convert`."""
