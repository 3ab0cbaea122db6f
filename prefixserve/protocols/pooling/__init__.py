"""The APIs over the engine's pooling: OpenAI's embeddings (``embeddings.py``) and vLLM's scoring over
them, ``/score`` and ``/rerank`` (``scoring.py``)."""
