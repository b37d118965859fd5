"""The shared training loop, distributed backends, checkpoints, tracking, and data (tasks + verifiers)."""
