"""kvcalib pipeline: the Hydra entry point, the stage runner and everything with side effects."""
__version__ = "0.1.0"
