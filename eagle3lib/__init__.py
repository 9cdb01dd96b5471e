"""eagle3lab: train EAGLE-3 speculative-decoding drafters, one notebook per stage."""
__version__ = "0.1.0"
