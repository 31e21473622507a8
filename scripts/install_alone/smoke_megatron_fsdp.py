"""install_alone smoke for automodel-megatron-fsdp-adapter: config, translation, megatron-fsdp import.

Sharding itself needs CUDA (megatron-fsdp's constructor calls torch.cuda); without it the manager
must refuse with MegatronFSDPUnavailableError before touching the model.
"""

import importlib

import torch
from torch import nn

from automodel.megatron_fsdp import (
    MegatronFSDPConfig,
    MegatronFSDPManager,
    MegatronFSDPUnavailableError,
    build_fully_shard_call,
)
from automodel.mesh import MeshContext, ParallelismSizes, destroy_distributed, init_distributed

if __name__ == "__main__":
    config = MegatronFSDPConfig(zero_dp_strategy=3, grad_reduce_in_fp32=True)
    call = build_fully_shard_call(
        config,
        dp_shard_dim="dp",
        tp_dim="tp",
        unit_modules=[nn.Linear],
        dp_group_size=2,
        gradient_divide_factor=1.0,
    )
    megatron_fsdp = importlib.import_module("megatron_fsdp")  # the declared dependency, pure Python
    refused = "CUDA present"
    if not torch.cuda.is_available():
        init_distributed()
        manager = MegatronFSDPManager(
            config, MeshContext.build(ParallelismSizes()), gradient_divide_factor=1.0
        )
        try:
            manager.parallelize(nn.Sequential(nn.Linear(4, 4)))
        except MegatronFSDPUnavailableError as e:
            refused = str(e).splitlines()[0]
        else:
            raise AssertionError("parallelize ran without CUDA")
        destroy_distributed()
    print(
        f"ok automodel-megatron-fsdp-adapter: {type(call).__name__}, {megatron_fsdp.__name__} imported; {refused}"
    )
