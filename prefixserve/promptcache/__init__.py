"""Prompt Cache: schemas of reusable prompt modules (PML), their position layout, and (to come) module
encoding at fixed positions and cached inference over shared module blocks."""
