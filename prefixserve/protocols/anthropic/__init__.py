"""Anthropic's Messages API, run as one chat turn: its body (``request.py``), one message prepared and
answered (``prepare.py``), its stream (``stream.py``), and the Message Batches API's path and pages
(``message_batches.py``)."""
