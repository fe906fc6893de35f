"""Glue to the frameworks people use today: torch.distributed, PyTorch DCP, DeepSpeed, torch.save."""
