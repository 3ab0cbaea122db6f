"""Attention over the paged KV cache: the backends, what a step tells them, their plans and their kernels.

  * this package: the backend interface and registry (``backend.py``), what a step tells the backends
    (``metadata.py``), and the backends: ``reference.py`` (the oracle), ``cascade.py`` (torch),
    ``auto.py`` (cascade or per sequence, each step; Triton on CUDA), ``no_attention.py`` (a benchmark
    ceiling) and ``triton_backend.py`` ("triton", "triton_paged"); with what they share: the exact LSE
    merge in torch (``merge.py``), sliding-window layers (``window.py``), attention in captured decode
    graphs (``graph.py``: the scheme; ``graph_attention.py``: the Triton kernels under it;
    ``window_graph.py``: sliding layers inside them), long prefills through torch's fused attention
    (``dense_prefill.py``: cuDNN's or FlashAttention-2's kernel behind SDPA), a Triton
    step's launch paths and their replay (``step_launch.py``) and the ptxas that builds the mixed kernel
    (``_ptxas.py``). The Triton backends' host side stays here beside the other backends rather than in
    a package of its own: it runs a step (launches, replays, graph captures), so it is backend code,
    neither a plan nor a kernel;
  * ``planning/``: host-side planning, no device code: shared segments, plans carried across decode
    steps, sliding-window plans, the kernels' work lists, tile choices and launch rules;
  * ``kernels/``: the Triton and Gluon kernels, one a module with its launch wrapper.

Imports between planning, kernels and the Triton backends go one way, down this order (a module
imports only modules before it; function-level imports included; tests/kernels/test_kernel_imports.py
checks it):

    planning.plan < planning.context_segments < planning.decode_plans < planning.window_plan < _ptxas
    < kernels.turn < kernels.merge < planning.tiles < kernels.attend < planning.e4m3_walks
    < kernels.packed_decode < kernels.paged_attention < kernels.gluon_attend < kernels.shared_gluon
    < kernels.shared_gluon_fp8 < planning.shared_plan < kernels.shared_attention < planning.mixed_rule
    < kernels.mixed_own < kernels.mixed_gluon < planning.step_plan < step_launch < planning.window_work
    < kernels.window_attention < graph_attention < triton_backend

Planning and kernels interleave there: a kernel's wrapper takes its planner's work list
(``shared_attention`` runs ``shared_plan``'s), and a planner asks a kernel whether it can run
(``shared_gluon.eligible_for``).
"""
