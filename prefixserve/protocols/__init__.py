"""The APIs prefixserve speaks, apart from any server: request bodies -> the engine's prepared requests,
and engine outputs -> response bodies and stream events.

One sub-package per dialect: ``openai/`` (completions and chats, which the other generating APIs run
as), ``responses/`` (OpenAI's Responses API), ``anthropic/`` (Anthropic's Messages API),
``pooling/`` (embeddings, and vLLM's scoring over them) and ``vllm/`` (vLLM's extra routes: the
tokenizer, the prefix-cache reset); ``errors.py`` and ``ids.py`` are every dialect's. The HTTP
server (``entrypoints/openai/``), the offline batch runner and the Ray ingress all import from here.
No web framework: nothing here imports FastAPI or starlette (pydantic models are the request
shapes), so the batch runner and the Ray ingress's routing run without them.
"""
