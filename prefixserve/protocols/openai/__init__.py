"""OpenAI's completions and chats: request models (``request_models.py``), a body to engine work and
outputs back to a body (``prepare.py``, ``format.py``), tools, structured outputs, reasoning, and the
stream states the other generating APIs' streams build on (``event_stream.py``); ``lists.py``: the
Files and Batch APIs' paths and OpenAI's cursor page."""
