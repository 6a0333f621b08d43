"""Small helpers with no torch.distributed dependency."""
