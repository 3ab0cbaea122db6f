"""The OpenAI-compatible HTTP server (``prefixserve serve``): routes, app assembly, answering
(queueing, streaming) and overload as HTTP (429s, the queue-delay header, watched streams).

What a request body means and what an answer looks like is ``prefixserve/protocols/``'s, shared with
the batch runner and the Ray ingress; the engine on a thread or in its own process, overload control
and the server's logs are ``prefixserve/serving/``'s. Nothing is imported here. Import from the
modules: ``openai.server`` (``ServerThread``, ``build_app``, ``serve``), ``openai.app`` (routes),
``openai.answering``, ``openai.overload_http``, ``openai.requests``, ``openai.metrics``.
"""
