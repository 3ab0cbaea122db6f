"""The names of the attention layer types, as HF configs write them in ``layer_types``."""

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # Gated DeltaNet (Qwen3.5, Qwen3-Next): a recurrent state, no KV cache
LAYER_TYPES = (FULL, SLIDING, LINEAR)
