"""transport: move bytes and tensors inside a torch.distributed group (no InputMetadata here)."""
