"""Head-group page pool: allocator, KV buffers, owner segments, exact reservation, the KV manager facade."""
