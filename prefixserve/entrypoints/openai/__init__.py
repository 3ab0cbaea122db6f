"""The OpenAI-compatible HTTP server (``prefixserve serve``) and the OpenAI request/response shapes it
shares with the batch runner.

Nothing is imported here: importing ``prepare`` or ``protocol`` (as the batch runner does) must not pull
in FastAPI or uvicorn. Import from the modules: ``openai.server`` (``ServerThread``, ``build_app``,
``serve``), ``openai.app`` (routes), ``openai.engine_thread`` / ``openai.engine_process`` (the engine
on a thread or in a child process), ``openai.prepare``, ``openai.protocol``, ``openai.requests``,
``openai.format``, ``openai.metrics``.
"""
