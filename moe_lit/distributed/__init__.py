"""Distributed plans and state helpers, kept apart from the model and from Lightning.

* :mod:`~moe_lit.distributed.sharding`: the mixed-precision policies and the FSDP2 plan
  (``fully_shard`` per Block, then the whole network);
* :mod:`~moe_lit.distributed.mesh`: the expert-parallel device mesh and the expert split;
* :mod:`~moe_lit.distributed.optim_state`: full optimizer states of a sharded model, renumbered
  so that a checkpoint moves between FSDP1, FSDP2, DDP and one device.

The Lightning strategies that use them live in :mod:`moe_lit.lit.strategies`.
"""
