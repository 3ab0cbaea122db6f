"""Structured outputs: JSON schema, JSON object, regex, choice and EBNF grammars through xgrammar.

``grammars`` checks and compiles specs, ``decoding`` keeps each sequence's matcher and fills a
step's token bitmask on the host, ``bitmask`` applies it to the logits on the device. Nothing here
is imported by the engine until a constrained request arrives: xgrammar is optional.
"""
