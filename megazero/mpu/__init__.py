"""megazero.mpu: the model-parallel unit, with Megatron-LM's names.

It also satisfies DeepSpeed's ``mpu=`` contract
(``get_{model,data}_parallel_{rank,group,world_size}``), so the module itself
can be passed as ``deepspeed.initialize(..., mpu=megazero.mpu)``.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .distributed import default_backend, distributed_run, export_slurm_env, init_distributed, shutdown_distributed
from .initializers import (
    copy_tensor_model_parallel_attributes,
    init_method_normal,
    init_method_zeros,
    modules_with_direct_parameters,
    reset_parameters_in_order,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .parallel_state import (
    ParallelGroups,
    context_parallel_rank,
    destroy_model_parallel,
    get_context_parallel_global_ranks,
    get_context_parallel_group,
    get_expert_data_parallel_group,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_group,
    get_expert_tensor_parallel_group,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_hierarchical_context_parallel_groups,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_device,
    get_embedding_group,
    get_embedding_ranks,
    get_position_embedding_group,
    get_virtual_pipeline_model_parallel_world_size,
    is_rank_in_embedding_group,
    is_rank_in_position_embedding_group,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_parallel_groups,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
    group_ranks,
    rank_grid,
)
from .random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from .sharding import full_from_shards, gather_tensor_model_parallel, is_tp_sharded, shard_of_full
from .utils import NO_GROUP, VocabUtility, divide, pad_vocab_size, split_tensor_along_last_dim


def is_model_parallel_parameter(param) -> bool:
    """True for TP shards (Megatron's ``param_is_not_tensor_parallel_duplicate`` negated)."""
    return bool(getattr(param, "tensor_model_parallel", False))

