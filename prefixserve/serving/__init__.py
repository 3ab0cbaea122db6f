"""What a server adds around the engine, below its HTTP layer: admission (the waiting queue's bounds,
queue deadlines and their slot schedule, what an overloaded server refuses) and the process's upkeep
(giving freed host memory back). The offline paths never import it."""
