"""gemrec: training GEM-style ads recommendation foundation models."""

__version__ = "0.1.0"
