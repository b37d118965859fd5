"""The shared training loop and what it runs on: setup, distributed backends, checkpoints, tracking,
the prompt stream, the default model's warm-start stage, HiLoRe activations and AugTree replay."""
