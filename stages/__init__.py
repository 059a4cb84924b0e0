"""Pure calibration stages: inputs + config in, tensors + metadata out. No files, no MLflow, no Hydra."""
