"""Training: Config, devices, the builder, the jitted step, the loop with its callbacks and train()."""
