"""Host-side planning of attention: what a step's kernels will do, worked out on the host before any launch.

Everything here is host work (numpy and CPU tensors; nothing reads the device, and nothing needs Triton
at import); the kernels (``attention/kernels/``) take its results as launch arguments, the backends
(``attention/``) make them once a step and carry them across layers and decode steps.

  * plan: the shared-segment plan (``SharedPlan``, ``make_plan``): which KV runs several sequences of
    a step hold, and each sequence's own part; what every sharing backend (cascade, auto, triton) runs;
  * context_segments: a prefill's own cached context as segments of one holder, where the shared
    kernels' tall tiles beat the paged kernel (``ContextRule``, ``with_context_segments``);
  * decode_plans: plans carried from one decode step to the next instead of made again (``DecodePlans``);
  * window_plan: a sliding-window layer's shared work in a decode step (the segments' parts inside their
    holders' windows);
  * shared_plan: the shared-segment kernels' work list (M-tiles x KV splits, partial slots) and the
    rules that size its tiles;
  * mixed_rule: when a decode step runs as one mixed launch, and with which own and shared tiles;
  * step_plan: a step's host work on the Triton path (the host plan and its one asynchronous copy to the
    device, the own pack, the work list with its mixed tiles), shared by the eager backend and the
    decode graphs;
  * tiles: tile sizes fitted to shared memory and the SM count, with what the kernels' launch wrappers
    share on the host (argument checks, dot precision, launches that retry with smaller tiles).

A rule here asks a kernel module only whether its kernel can run (``kernels.shared_gluon.eligible_for``)
or how many decode sequences it packs (``kernels.packed_decode.decode_pack``); the one-way import order
of planning, kernels and the Triton backends is in the ``prefixserve.attention`` docstring. The package
imports nothing itself: import the module you need.
"""
