"""tierlm: full-parameter LLM training on one consumer GPU over a tiered GPU/RAM/NVMe store."""

__version__ = "0.1.0"
