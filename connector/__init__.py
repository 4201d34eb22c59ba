"""The engine side of kvfs: KV blocks from device memory into the canonical host layout, the
host tier, and the cascade to secondary tiers. Needs torch; runs the same code on CPU tensors
and on CUDA tensors."""
