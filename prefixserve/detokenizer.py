"""Incremental detokenization: a sequence's output text grown by O(new tokens) work per step.

Re-decoding the whole output every step costs O(n) per step, O(n^2) over a generation. Instead each
sequence keeps a short window of trailing token ids and decodes only that window when tokens arrive;
the text the new tokens add is what the window's text gained past the characters already emitted.

Exactness: after every ``add``, ``text + pending`` equals ``tokenizer.decode(all_ids,
skip_special_tokens=True)``, or, given the prompt's last ids as ``context`` (as vLLM primes its
detokenizer with them), what decoding them before all_ids adds to their own text: the same for
byte-level BPE, and a SentencePiece output's first word keeps its leading space (" Paris", not "Paris"),
which decoding the output alone strips. Two things make a window's text differ from the text those
ids contribute to the full decode, and both are handled:

* A multi-byte UTF-8 character split over several byte-level tokens decodes as U+FFFD until its last
  byte arrives. A trailing run of U+FFFD is therefore held back in ``pending`` (not yet in ``text``); it
  is emitted once a later character settles it (then it is either the real character, or a U+FFFD that
  stays because the bytes were invalid). The window is cut at a point where its text did not end in
  U+FFFD, where byte-level decoding is in a clean state; or, in a run of byte fragments that never
  settles, where decoding the two sides apart gives the same text as together (``_settle_run``): the
  invalid bytes' U+FFFD before that cut are final, and are settled into ``text``.
* Decoders that treat the first token specially (SentencePiece drops the leading space of the text)
  are handled as vLLM does: the window keeps the tokens since the previous settled point in front of
  the new ones as context (never a context that decodes to nothing), and only the characters past the
  context's own text are new.

It assumes what holds for byte-level BPE (the default model's tokenizer) and SentencePiece without
byte fallback: decoding more ids only appends to the text, apart from the U+FFFD tail. Decoders that
rewrite earlier text (``clean_up_tokenization_spaces`` on WordPiece, byte-fallback groups turning
invalid) can make the streamed text differ from a full decode.

Special tokens are skipped exactly as ``decode(..., skip_special_tokens=True)`` skips them, because
the window is decoded with that very call (``convert_ids_to_tokens`` would skip a different set: only
``all_special_ids``, not every added token marked special).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what an incomplete or invalid UTF-8 byte sequence decodes to

# transformers classes whose ``decode(ids, skip_special_tokens=s)`` is the Rust tokenizer's
# ``decode(ids, skip_special_tokens=s)`` plus an optional clean-up (fast tokenizers, v4 and v5).
_PLAIN_DECODE = {"transformers.tokenization_utils_base"}
_PLAIN_INNER_DECODE = {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}

# The window is cut back to its last settled point once it holds more ids than this: each step decodes
# at most about this many ids, and a cut (one extra small decode) happens about once per WINDOW tokens.
WINDOW = 8

PROMPT_CONTEXT = 5  # prompt ids an output's text is decoded after (vLLM's initial detokenization offset)


def cuts_runs(tokenizer: Any) -> bool:
    """Whether a run of ids whose text never settles may be cut where decoding its two sides apart
    gives the same text (``IncrementalDetokenizer._settle_run``): a Rust tokenizer whose decoder
    turns each token's bytes into text independently of how the ids are grouped, apart from the
    open character at the end (byte-level BPE). Not with byte fallback (SentencePiece's ``<0xXX>``
    pieces): a run of them that is invalid anywhere decodes to U+FFFD throughout, so text that two
    sides gave apart can change as the run grows; nor where the decoder cannot be seen."""
    decoder = getattr(getattr(tokenizer, "_tokenizer", None), "decoder", None)
    return decoder is not None and "ByteFallback" not in repr(decoder)


def make_decode(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, as cheaply as it can be had exactly.

    For a transformers fast tokenizer that does no clean-up, that is the Rust tokenizer's own decode:
    calling it directly skips the wrapper's per-id conversion, most of the cost of decoding a few ids.
    Anything else (other classes, overridden decoding, clean-up on) goes through ``tokenizer.decode``.
    """
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    plain = (
        type(backend).__module__.startswith("tokenizers")
        and hasattr(backend, "decode")
        and getattr(cls.decode, "__module__", None) in _PLAIN_DECODE
        and getattr(getattr(cls, "_decode", None), "__module__", None) in _PLAIN_INNER_DECODE
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    decode = backend.decode if plain else tokenizer.decode
    return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One sequence's output text, fed token ids as they are generated.

    ``add(ids)`` returns the text the ids settled (a delta; deltas concatenate to ``text``). ``text`` is
    the settled text, which never ends in an incomplete character (it may end in the U+FFFD of
    invalid bytes); ``pending`` is the unsettled tail (U+FFFD characters); ``full_text`` (= ``text +
    pending``) is what ``tokenizer.decode`` of all ids gives, including a final incomplete character
    when generation ends on one.
    """

    __slots__ = (
        "_cuts_runs",
        "_decode",
        "_emitted",
        "_len",
        "_mark",
        "_pieces",
        "_searched",
        "_window",
        "num_ids",
        "pending",
    )

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self._decode = make_decode(tokenizer, skip_special_tokens)
        self._cuts_runs = cuts_runs(tokenizer)  # whether a never-settling run may be cut (``_settle_run``)
        self._window: list[int] = []  # the trailing ids being decoded (context + unsettled + new)
        self._emitted = 0  # characters of the window's text already in ``text``
        self._mark = 0  # window index of the last settled point: where the window can be cut
        if context:  # the prompt's last ids: the output's text is what it adds to theirs (see above)
            try:
                primed = self._decode(list(context))
            except Exception:  # ids this tokenizer cannot decode: no context
                primed = ""
            if primed and not primed.endswith(REPLACEMENT):
                self._window, self._emitted, self._mark = list(context), len(primed), len(context)
        self._pieces: list[str] = []  # ``text``, in pieces joined on demand
        self._len = 0  # len(text)
        self._searched = 0  # len(text) at the previous ``find_first``
        self.num_ids = 0  # token ids fed so far
        self.pending = ""  # the unsettled tail: decoded, but it may still change

    # ---- feeding -------------------------------------------------------------------------------
    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed newly generated token id(s); returns the text they settled (may be "")."""
        window = self._window
        before = len(window)
        if isinstance(token_ids, int):
            window.append(token_ids)
        else:
            window.extend(token_ids)
        if len(window) == before:
            return ""
        self.num_ids += len(window) - before
        text = self._decode(window)
        end = len(text)
        while end > self._emitted and text[end - 1] == REPLACEMENT:
            end -= 1  # hold back what may be an incomplete character
        delta = text[self._emitted : end]
        if delta:
            self._pieces.append(delta)
            self._len += len(delta)
            self._emitted = end
        self.pending = text[self._emitted :]
        if self.pending and len(window) > 2 * WINDOW and self._cuts_runs:  # a run that never settles
            delta += self._settle_run(text)
        elif not self.pending:  # a settled point: the text ends in a whole character, decoding is clean
            if len(window) > WINDOW and self._mark > 0:
                # Keep the ids since the previous settled point as context for what comes next, if they
                # make text: context that decodes to "" (special tokens, a lone SentencePiece space the
                # decoder strips) would leave the next token first in its window, as it is not.
                context = self._decode(window[self._mark :])
                if context:
                    del window[: self._mark]
                    self._emitted = len(context)
            self._mark = len(window)
        return delta

    def _settle_run(self, text: str) -> str:
        """Cut a window whose text has ended in U+FFFD since its last settled point (tokens of byte
        fragments that never complete a character), so that a step does not decode the whole run.

        Of a trailing run of U+FFFD only the last can still change (the bytes of an incomplete
        character); the others are invalid bytes, final. The window is cut before the latest token
        where decoding the two sides apart gives the text decoding them together does: then no open
        character spans the cut (if the token after it continued one, apart its byte would be a U+FFFD
        of its own, or the character would be missing), and the text before the cut is final: it
        is settled (returned), U+FFFD included, and the window keeps the ids after the cut."""
        window = self._window
        # the latest cuts first, a bounded number of them an ``add`` (ids that decode to nothing, such
        # as skipped special tokens, would otherwise make every ``add`` try the whole window)
        for cut in range(len(window) - 1, max(self._mark, len(window) - 1 - 2 * WINDOW), -1):
            tail = self._decode(window[cut:])
            if not tail:  # no byte after the cut yet: nothing proves an open character ended there
                continue
            head = self._decode(window[:cut])
            if len(head) < self._emitted or head + tail != text:
                continue
            delta = head[self._emitted :]
            if delta:
                self._pieces.append(delta)
                self._len += len(delta)
            del window[:cut]
            self._emitted = self._mark = 0
            self.pending = text[len(head) :]
            return delta
        return ""

    # ---- reading -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The settled text (never ends in an incomplete character)."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @property
    def full_text(self) -> str:
        """The text of all ids fed so far, exactly as ``tokenizer.decode`` gives it."""
        return self.text + self.pending if self.pending else self.text

    @property
    def num_chars(self) -> int:
        """len(text), without joining it."""
        return self._len

    def text_from(self, start: int) -> str:
        """``full_text[start:]``, copying only the characters from ``start`` on."""
        need = self._len - start
        if need <= 0:
            return self.pending[-need:]
        pieces = self._pieces
        got, i = 0, len(pieces)
        while got < need:
            i -= 1
            got += len(pieces[i])
        return "".join((pieces[i][got - need :], *pieces[i + 1 :], self.pending))

    def find_first(self, stops: Sequence[str]) -> tuple[int, str] | None:
        """The earliest stop string in ``full_text`` that ends past the text already searched: (where
        it starts, which one), or None.

        Meant to be called after each ``add`` while no stop string has been found yet: it looks only at
        the text that could hold an occurrence the previous call did not see (text settled since then,
        the ``max(len(stop)) - 1`` characters before it, and ``pending``), and gives the same answer
        as searching all of ``full_text``. Ties at one position go to the smaller string, as ``min``
        over ``(position, stop)`` pairs would. After ``skip_search`` the text settled by then is out of
        the search: only occurrences that end past it count.
        """
        if not stops:
            return None
        searched = self._searched
        start = max(0, searched - max(map(len, stops)) + 1)
        self._searched = self._len  # an occurrence ending in text settled by now is seen now or never
        tail = self.text_from(start)
        seen = searched - start  # in ``tail``: an occurrence must end past it
        hits = [(at, s) for s in stops if (at := tail.find(s, max(0, seen - len(s) + 1))) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        return start + at, stop

    def skip_search(self) -> None:
        """Leave the text settled so far out of later ``find_first`` calls (``min_tokens``: a stop string
        counts only where it ends in text generated after them, as vLLM searches only new text)."""
        self._searched = self._len


def decode_output(
    tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], skip_special_tokens: bool = True
) -> str:
    """An output's whole text as the engine's detokenizer gives it: decoded after the prompt's last
    ``PROMPT_CONTEXT`` ids (for outputs made outside a sequence, e.g. beam search's)."""
    context = [t for t in prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT) :] if t >= 0]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context=context)
    detok.add(output_ids)
    return detok.full_text
