"""Scale-out on existing distributed engines (Ray for offline batches); nothing home-made."""
