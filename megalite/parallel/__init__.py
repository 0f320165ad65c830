"""Tensor, pipeline and data parallelism primitives: process groups, collectives, layers."""
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    pad_vocab_size,
)
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.parallel.random import get_rng_tracker, model_parallel_manual_seed
from megalite.parallel.state import (
    destroy_model_parallel,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_ranks,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_embedding_group,
    get_model_parallel_group,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_ranks,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_rank_in_embedding_group,
    model_parallel_is_initialized,
    set_virtual_pipeline_model_parallel_rank,
)

__all__ = [name for name in dir() if not name.startswith("_")]
