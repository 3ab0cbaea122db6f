"""Structured outputs: JSON schema, JSON object, regex, choice and EBNF grammars through xgrammar.

``grammars`` checks and compiles specs, ``decoding`` keeps each sequence's matcher and fills a
step's token bitmask on the host, ``bitmask`` applies it to the logits on the device, ``rule`` is the
request rule the engine calls them through (``sampling/rules.py``). xgrammar is optional: it is
imported only when the first constrained request arrives.
"""
