"""A kernel's wait for a word of pinned host memory that another process writes (a grammar fill's flag).

Both kernels that wait for a grammar's fill (``wait_for_fill`` here, for ``structured/gate.py``, and
the flagged argmax of ``sampling/argmax_kernels.py``) spin the same way: volatile loads (Triton 3.6
drops a ``.cv`` modifier; such a load was hoisted out of the loop and never saw the host's write),
bounded by the GPU's own clock (``globaltimer``, ns), or under the interpreter, which has no clock,
by a count of spins.
Imported at a kernel's first use (it imports Triton).
"""

from __future__ import annotations

import importlib

from prefixserve.triton_support import require_triton

triton, tl = require_triton()
clock = importlib.import_module("triton.language.extra.cuda").globaltimer  # ns, the GPU's own


@triton.jit
def wait_for_word(ptr, want, limit, TIMED: tl.constexpr):
    """Spin until the word at ``ptr`` is ``want`` or ``-want``, or ``limit`` runs out (ns of the GPU's
    clock where ``TIMED``, else spins); returns (the word last seen, the spins taken)."""
    word = tl.load(ptr, volatile=True)
    spins = 0
    if TIMED:
        start = clock()
        while (word != want) & (word != -want) & (clock() - start < limit):
            word = tl.load(ptr, volatile=True)
            spins += 1
    else:
        while (word != want) & (word != -want) & (spins < limit):
            word = tl.load(ptr, volatile=True)
            spins += 1
    return word, spins


@triton.jit
def wait_for_fill(spins_ptr, flag_ptr, expect_ptr, seen_ptr, limit, TIMED: tl.constexpr):
    """One program: wait for the fill number at ``expect_ptr`` in the flag; record what it saw."""
    flag, spins = wait_for_word(flag_ptr, tl.load(expect_ptr, volatile=True), limit, TIMED)
    tl.store(seen_ptr, flag)
    tl.store(spins_ptr, spins)  # how long it waited (an error's message says)


__all__ = ["wait_for_fill", "wait_for_word"]
