"""Consumers of an exported artifact: the oracle, the Triton kernel, the transformers Cache and the check."""
