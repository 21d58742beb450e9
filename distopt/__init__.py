"""distopt: optimizers for parameters spread over torch.distributed.rpc workers."""

__all__: list = []
