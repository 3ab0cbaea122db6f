"""The names of the attention layer types, as HF configs write them in ``layer_types``."""

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
