"""The node's tier of the KV pool: DRAM, SSD and HBM blocks, placement, eviction and checksums."""
