"""Megatron-Core's public names at Megatron-Core's module paths.

The table lists names checked against Megatron-Core's ``dist_checkpointing`` source
(the modules this package mirrors); each must be importable from the same module
path here, and functions must accept Megatron-Core's positional parameters, in order
(extra keyword-only parameters are allowed). Not a complete audit of 0.13.1 and
0.19.2: names are added here as each module is checked.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

# module -> {name: Megatron-Core's positional parameter names (None: not a function)}
MEGATRON_NAMES: dict[str, dict[str, tuple[str, ...] | None]] = {
    "serialization": {
        "save": ("sharded_state_dict", "checkpoint_dir", "sharded_strategy", "common_strategy",
                 "validate_access_integrity", "async_sharded_save"),
        "load": ("sharded_state_dict", "checkpoint_dir", "sharded_strategy", "common_strategy",
                 "validate_access_integrity", "strict"),
        "load_common_state_dict": ("checkpoint_dir",),
        "load_tensors_metadata": ("checkpoint_dir", "sharded_strategy"),
        "load_sharded_metadata": ("checkpoint_dir", "sharded_strategy", "common_strategy"),
        "load_plain_tensors": ("checkpoint_dir",),
        "load_content_metadata": ("checkpoint_dir",),
        "remove_sharded_tensors": ("checkpoint_dir", "key_prefix"),
        "get_default_save_sharded_strategy": ("backend", "version"),
        "get_default_save_common_strategy": ("backend", "version"),
        "get_default_load_sharded_strategy": ("checkpoint_dir",),
        "verify_checkpoint_and_load_strategy": ("checkpoint_dir", "sharded_strategy",
                                                "common_strategy"),
    },
    "validation": {
        "StrictHandling": None,
        "parse_strict_flag": ("strict",),
        "validate_integrity_and_strict_load": ("sharded_state_dict", "strict",
                                               "validate_access_integrity", "local_metadata",
                                               "global_metadata", "ckpt_sharded_metadata"),
        "verify_checkpoint_and_load_strategy": ("checkpoint_dir", "sharded_strategy",
                                                "common_strategy"),
        "validate_sharding_integrity": ("global_metadata",),
        "determine_global_metadata": ("sharded_state_dict",),
        "adjust_non_strict_load": ("sharded_state_dict", "sharded_keys_to_remove"),
        "maybe_report_missing_and_unexpected_keys": ("missing_keys", "unexpected_keys",
                                                     "raise_error"),
        "validate_sharded_objects_handling": ("sharded_strategy", "common_strategy"),
    },
    "state_dict_utils": {
        "save_preprocess": ("sharded_state_dict", "validate_access_integrity",
                            "preprocess_common_before_consistancy_check"),
        "load_preprocess": ("sharded_state_dict",),
        "filter_out_empty_flatten_tensor": ("sharded_state_dict",),
    },
    "mapping": {name: None for name in (
        "ShardedBase", "ShardedTensor", "ShardedObject", "ShardedTensorFactory",
        "LocalNonpersistentObject", "is_main_replica", "apply_factories", "apply_factory_merges",
        "StateDict", "ShardedStateDict", "ReplicaId")},
    "utils": {
        "extract_sharded_tensors": ("sharded_state_dict",),
        "extract_sharded_tensors_and_factories": ("sharded_state_dict",),
        "extract_sharded_tensors_or_nonpersistent": ("sharded_state_dict",),
        "extract_sharded_base": ("sharded_state_dict",),
        "extract_nonpersistent": ("sharded_state_dict",),
        "add_prefix_for_sharding": ("sharded_state_dict", "prefix"),
        "replace_prefix_for_sharding": ("sharded_state_dict", "old_prefix", "new_prefix"),
        "apply_prefix_mapping": ("sharded_state_dict", "prefix_map"),
        "_sharded_tensor_shard_id": ("sharded_tensor",),
        "_sharded_object_id": ("sharded_object",),
        "zip_strict": (),
        "logger_stack": ("name", "current_logger"),
        "debug_time": ("name", "logger", "threshold", "level"),
        "debug_msg": ("msg",),
        "force_all_tensors_to_non_fp8": ("sharded_state_dict",),
    },
    "exchange_utils": {
        "ShardDistribution": None,
        "distribute_shards_to_ranks": ("shard_to_ranks", "shard_to_size", "num_ranks"),
        "determine_main_replica_uniform_distribution": ("sharded_state_dict",
                                                        "parallelization_group", "ignore_groups"),
        "exchange_loaded_tensors_gather_rounds": ("loaded_tensors", "unloaded_shards",
                                                  "shard_distribution", "parallelization_group"),
        "exchange_loaded_tensors_gather_object": ("loaded_tensors", "unloaded_shards",
                                                  "shard_distribution", "parallelization_group"),
        "exchange_loaded_tensors_broadcast": ("loaded_tensors", "unloaded_shards",
                                              "shard_distribution", "parallelization_group"),
        "exchange_loaded_objects_gather_object": ("loaded_objects",),
        "exchange_by_distribution": ("loaded_tensors", "unloaded_shards", "shard_distribution",
                                     "parallelization_group", "exchange_algo"),
    },
    "optimizer": {
        "get_optim_param_to_id_map": ("optim_params_iter",),
        "get_param_id_to_sharded_param_map": ("model_sharded_state_dict", "optim_params_iter"),
        "make_sharded_optimizer_tensor": ("model_param", "optim_param", "prefix"),
        "optim_state_to_sharding_state": ("optim_state_dict", "id_to_sharded_param_map",
                                          "exclude_keys"),
        "KEEP_VARS_HINT": None,
    },
    "tensor_aware_state_dict": {"MCoreTensorAwareStateDict": None},
    "strategies.fully_parallel": {
        "FullyParallelSaveStrategyWrapper": None,
        "FullyParallelLoadStrategyWrapper": None,
        "distribute_main_replicas_with_precomputed_distribution": (
            "sharded_state_dict", "parallelization_group", "precomputed_distribution"),
    },
    "strategies.resharding": {
        "TensorReformulationMetadata": None,
        "nd_flattened_tensor_reformulated_global_shape": ("sh_ten",),
        "is_nd_flattened_tensor": ("sh_ten",),
        "apply_nd_flattened_tensors_reformulation": ("sharded_state_dict",
                                                     "reformulation_metadata"),
        "restore_nd_flattened_tensors_formulation": ("state_dict",
                                                     "formulation_restore_metadata"),
        "reformulate_single_nd_flattened_tensor": ("sh_ten", "reformulation_metadata"),
    },
    "strategies.cached_metadata_filesystem_reader": {"CachedMetadataFileSystemReader": None},
    "strategies.async_utils": {name: None for name in (
        "AsyncRequest", "AsyncCallsQueue", "AsyncCaller", "TemporalAsyncCaller",
        "PersistentAsyncCaller")},
    "strategies.filesystem_async": {"FileSystemWriterAsync": None},
    "strategies.state_dict_saver": {
        "save_state_dict_async_plan": ("state_dict", "storage_writer", "process_group",
                                       "coordinator_rank", "planner"),
        # Megatron-Core's third parameter is DCP's private _DistWrapper; ours is a process
        # group (the wrapper is private torch API we do not build on).
        "save_state_dict_async_finalize": ("storage_writer", "global_metadata"),
    },
    "strategies.torch": {name: None for name in (
        "TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy", "MCoreSavePlanner",
        "MCoreLoadPlanner", "sharded_tensor_to_torch_sharded_tensor", "mcore_to_pyt_state_dict",
        "flatten_state_dict", "unflatten_state_dict")},
    "strategies.common": {"TorchCommonSaveStrategy": None, "TorchCommonLoadStrategy": None},
    "strategies.base": {name: None for name in (
        "StrategyAction", "get_default_strategy", "register_default_strategy",
        "LoadCommonStrategy", "LoadShardedStrategy", "SaveCommonStrategy", "SaveShardedStrategy",
        "AsyncSaveShardedStrategy")},
    "core": {"CheckpointingConfig": None, "check_is_distributed_checkpoint": ("checkpoint_dir",),
             "maybe_load_config": ("checkpoint_dir",), "save_config": ("config", "checkpoint_dir"),
             "CheckpointingException": None},
}  # fmt: skip

CASES = [(m, n, p) for m, names in MEGATRON_NAMES.items() for n, p in names.items()]


@pytest.mark.parametrize(("module", "name", "params"), CASES, ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_megatron_name_exists_with_compatible_signature(
    module: str, name: str, params: tuple[str, ...] | None
) -> None:
    mod = importlib.import_module(f"dist_checkpointing.{module}")
    obj = getattr(mod, name)
    if params is None:
        return
    signature = inspect.signature(obj)
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    assert positional[: len(params)] == list(params), (module, name, positional)
