"""Multi-rank modes: CFG-parallel and Ulysses sequence parallelism over torch.distributed."""
