"""Import PyTorch programs (``torch.export``) into turnip's tensor IR: ``from_torch`` (``turnip.torchimport.api``)."""
