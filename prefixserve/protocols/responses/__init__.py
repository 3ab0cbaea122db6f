"""OpenAI's Responses API, run as one chat turn: its body (``request.py``), one response prepared and
answered (``prepare.py``), its items and usage (``items.py``), its stream (``stream.py``) and the
stored responses ``previous_response_id`` goes on from (``store.py``)."""
