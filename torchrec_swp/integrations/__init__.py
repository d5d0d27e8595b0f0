"""Integrations with training libraries. Only ``integrations.torchrec`` imports TorchRec."""
