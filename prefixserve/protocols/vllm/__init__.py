"""vLLM's extra routes' bodies: the tokenizer's (``tokenizer.py``) and the prefix-cache reset's
(``cache_reset.py``)."""
