"""Serialized artifact formats: the codec (the one definition of the cache ABI), manifest and writers."""
