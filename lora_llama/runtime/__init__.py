"""How a process runs: precision and what auto picks, glibc's allocator, several processes through torch.distributed."""
