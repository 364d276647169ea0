"""Integrations: the torch ops and SDPA drop-in, the transformers attention backend, and context parallelism over
``torch.distributed``.
"""
