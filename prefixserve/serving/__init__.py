"""What a server adds around the engine, below its HTTP layer: the engine on a thread
(``engine_thread``) or in its own process (``engine_process``), admission (the waiting queue's bounds,
queue deadlines and their slot schedule, what an overloaded server refuses: ``admission``,
``slot_schedule``, ``overload``), and the process's upkeep (giving freed host memory back, the stats
and request log lines: ``host_trim``, ``stats_log``, ``request_log``). No web framework and no HTTP
answers here: the server (``entrypoints/openai/``) and the Ray replicas build on it. The offline paths
never import it."""
