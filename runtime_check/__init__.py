"""What proves a served cache: the oracle (reference.py: attention over the artifact's decoded rows), the check
driver and its tolerance (check.py). The readers it proves -- the Cache, the block-wise attention, the CPU and
Triton kernels -- are serving/'s; this package imports them, never the other way round."""
