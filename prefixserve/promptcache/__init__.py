"""Prompt Cache: schemas of reusable prompt modules (PML) and their position layout, modules encoded
once at fixed positions and kept on the GPU, in host memory and on disk, prompts assembled from them
with a few rows recomputed in context (accuracy recovery), and the device calls that encode them."""
