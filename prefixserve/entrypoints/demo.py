"""What ``prefixserve generate`` runs without prompts: questions that share one system prompt, and the
line that reports what the sharing saved, read from the engine's counters.

The system prompt is long enough (about 300 tokens with the chat template) for the attention planner to
attend it once for all the questions at each step: a segment is worth its own attention when its
holders would otherwise re-read at least ``CascadeCost.min_segment_saving`` (256) KV rows, which three
holders of a 64-token prompt (the demo's earlier one) never do.
"""

from __future__ import annotations

from collections.abc import Mapping

DEMO_SYSTEM = """\
You are the customer assistant of Northwind Journeys, a small travel company that plans independent \
trips in Europe and Asia for travellers who book flights, trains and hotels themselves.

How to answer:
- Answer in one or two sentences, then give exactly one practical tip on its own line, starting with \
"Tip:".
- Never invent prices, opening hours, timetables or visa rules. If the traveller needs a figure, say \
where to check it (the operator's own website, the embassy, the station's ticket office).
- Prefer public transport, walking and trains over taxis and domestic flights when the difference in \
time is small, and say so when it is.
- Mention the season when it matters: weather, crowds, festivals and public holidays change what a \
place is like more than anything else.
- If a question is about safety or health, give the general advice and point to the official travel \
advice of the traveller's own government.
- Do not recommend a specific hotel, restaurant or tour company by name; describe the kind of place \
to look for instead.
- If you do not know, say that you do not know.

What travellers usually want from us: a clear first answer they can act on today, the one thing \
that people most often get wrong, and where to look for the details. They read on their phones, \
often while they are already travelling, so keep it short and concrete, use plain words, and avoid \
lists unless they ask for one.
"""

DEMO_QUESTIONS = [
    "What is the best time of year to visit Kyoto?",
    "How do I get from the airport to the center of Lisbon?",
    "What should I pack for a week in Iceland in October?",
]


def sharing_report(m: Mapping[str, float], modules: bool = False) -> str:
    """The summary (two lines): prompt tokens served from the prefix cache, and the KV rows attention read
    against what a per-sequence path reads (the difference is what shared-segment attention saved)."""
    read, logical = int(m["attention_kv_tokens_read_total"]), int(m["attention_kv_tokens_logical_total"])
    reused = f", from prompt modules {int(m['module_tokens_reused_total']):,}" if modules else ""
    saved = logical - read
    share = f" ({saved / logical:.0%})" if logical else ""
    return (
        f"prompt tokens {int(m['prompt_tokens_total']):,}, "
        f"from prefix cache {int(m['prefix_cache_hit_tokens_total']):,}{reused}\n"
        f"KV rows read by attention {read:,} of {logical:,} a per-sequence path reads: "
        f"{saved:,} saved{share}, shared-segment attention in {int(m['cascade_steps_total'])} of "
        f"{int(m['steps_total'])} steps"
    )


__all__ = ["DEMO_QUESTIONS", "DEMO_SYSTEM", "sharing_report"]
