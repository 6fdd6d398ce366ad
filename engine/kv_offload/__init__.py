"""A second tier under the prefix cache (docs/engine.md, "KV offload").

`index` is the block manager's side (pure ints: hash -> slot, LRU); `store` is the model
runner's (the bytes: a file on CPU, pinned host memory on CUDA)."""
