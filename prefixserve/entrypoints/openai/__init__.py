"""The OpenAI-compatible HTTP server (``prefixserve serve``): routes, app assembly, the engine on a
thread or in its own process, and answering (queueing, overload, streaming).

What a request body means and what an answer looks like is ``prefixserve/protocols/``'s, shared with
the batch runner and the Ray ingress. Nothing is imported here. Import from the modules:
``openai.server`` (``ServerThread``, ``build_app``, ``serve``), ``openai.app`` (routes),
``openai.engine_thread`` / ``openai.engine_process`` (the engine on a thread or in a child process),
``openai.answering``, ``openai.requests``, ``openai.metrics``.
"""
