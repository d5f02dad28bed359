"""Every public name of Megatron-Core 0.13.1's and 0.19.2's ``dist_checkpointing``.

The table was made by listing each module of the two releases' wheels (classes,
functions and constants defined at module level, and the names the packages
re-export; the legacy zarr, tensorstore and two_stage backends aside). Each entry is
``name: (params in 0.13.1, params in 0.19.2)`` where a params value is Megatron-Core's
positional parameter names (constructor parameters for classes), ``None`` for a name
whose parameters are not compared (constants, re-exports, classes without an
``__init__`` of their own), and ``NO`` when that release lacks the name.

Each name must be importable from the same module path here, and accept the
release's positional parameters in order (extra parameters after them are allowed).
Where the two releases disagree on an order, we follow 0.13.1 and list the
exception in ``CONFLICTS``. Names that cannot apply here exist and raise
``UnsupportedFeatureError`` when used (tests in tests/unit/test_module_map_names.py).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

NO = "absent"

# module (relative to dist_checkpointing; "" is the package) -> name -> (0.13.1, 0.19.2)
MEGATRON_NAMES: dict[str, dict[str, tuple[object, object]]] = {
    '': {
        'LocalNonpersistentObject': (None, None),
        'ShardedObject': (None, None),
        'ShardedTensor': (None, None),
        'check_is_distributed_checkpoint': (None, None),
        'load': (None, None),
        'load_common_state_dict': (None, None),
        'load_content_metadata': (None, None),
        'load_plain_tensors': (None, None),
        'load_tensors_metadata': (None, None),
        'remove_sharded_tensors': (None, None),
        'save': (None, None),
    },
    'core': {
        'CONFIG_FNAME': (None, None),
        'CheckpointingConfig': (None, None),
        'CheckpointingException': (None, None),
        'check_is_distributed_checkpoint': (('checkpoint_dir',), ('checkpoint_dir',)),
        'maybe_load_config': (('checkpoint_dir',), ('checkpoint_dir',)),
        'save_config': (('config', 'checkpoint_dir'), ('config', 'checkpoint_dir')),
    },
    'dict_utils': {
        'dict_list_map_inplace': (('f', 'x'), ('f', 'x')),
        'dict_list_map_outplace': (('f', 'x'), ('f', 'x')),
        'dict_map': (('f', 'd'), ('f', 'd')),
        'dict_map_with_key': (('f', 'd'), ('f', 'd')),
        'diff': (('x1', 'x2', 'prefix'), ('x1', 'x2', 'prefix')),
        'extract_matching_values': (('x', 'predicate', 'return_lists_as_dicts'), ('x', 'predicate', 'return_lists_as_dicts')),
        'inspect_types': (('x', 'prefix', 'indent'), ('x', 'prefix', 'indent')),
        'map_reduce': (('xs', 'key_fn', 'value_fn', 'reduce_fn'), ('xs', 'key_fn', 'value_fn', 'reduce_fn')),
        'merge': (('x1', 'x2', 'key'), ('x1', 'x2', 'key')),
        'nested_items_iter': (('x',), ('x',)),
        'nested_values': (('x',), ('x',)),
    },
    'exchange_utils': {
        'ShardDistribution': (None, None),
        'T': (None, None),
        'determine_main_replica_uniform_distribution': (('sharded_state_dict', 'parallelization_group', 'ignore_groups'), ('sharded_state_dict', 'parallelization_group', 'ignore_groups')),
        'distribute_shards_to_ranks': (('shard_to_ranks', 'shard_to_size', 'num_ranks', 'cross_parallelization_group_loads'), ('shard_to_ranks', 'shard_to_size', 'num_ranks', 'cross_parallelization_group_loads')),
        'exchange_by_distribution': (('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group', 'exchange_algo'), ('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group', 'exchange_algo')),
        'exchange_loaded_objects_gather_object': (('loaded_objects',), ('loaded_objects',)),
        'exchange_loaded_tensors_broadcast': (('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group'), ('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group')),
        'exchange_loaded_tensors_gather_object': (('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group'), ('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group')),
        'exchange_loaded_tensors_gather_rounds': (('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group'), ('loaded_tensors', 'unloaded_shards', 'shard_distribution', 'parallelization_group')),
        'is_float8tensor': (('tensor',), ('tensor',)),
        'logger': (None, None),
    },
    'gpt_checkpoint_interop': {
        'GPTCompatLayerMaps': (NO, None),
        'gpt_compatible_layer_maps': (NO, ('hybrid_layer_pattern',)),
        'retarget_fsdp_state_dict_to_gpt_checkpoint': (NO, ('state_dict', 'layer_maps', 'checkpoint_keys', 'checkpoint_prefix')),
        'retarget_sharded_state_dict_to_gpt_checkpoint': (NO, ('sharded_state_dict', 'layer_maps')),
    },
    'mapping': {
        'CommonStateDict': (None, None),
        'FactoryBuildFn': (None, None),
        'FactoryMergeFn': (None, None),
        'LocalNonpersistentObject': (('obj',), ('obj',)),
        'ReplicaId': (None, None),
        'ShardedBase': (None, None),
        'ShardedObject': (None, None),
        'ShardedStateDict': (None, None),
        'ShardedTensor': (None, None),
        'ShardedTensorFactory': (None, None),
        'StateDict': (None, None),
        'apply_factories': (('sharded_state_dict',), ('sharded_state_dict',)),
        'apply_factory_merges': (('x1', 'x2', 'key'), ('x1', 'x2', 'key')),
        'is_main_replica': (('replica_id',), ('replica_id',)),
        'logger': (None, None),
    },
    'optimizer': {
        'KEEP_VARS_HINT': (NO, None),
        'get_optim_param_to_id_map': (('optim_params_iter',), ('optim_params_iter',)),
        'get_param_id_to_sharded_param_map': (('model_sharded_state_dict', 'optim_params_iter'), ('model_sharded_state_dict', 'optim_params_iter')),
        'logger': (None, None),
        'make_sharded_optimizer_tensor': (('model_param', 'optim_param', 'prefix'), ('model_param', 'optim_param', 'prefix')),
        'optim_state_to_sharding_state': (('optim_state_dict', 'id_to_sharded_param_map', 'exclude_keys'), ('optim_state_dict', 'id_to_sharded_param_map', 'exclude_keys')),
    },
    'serialization': {
        'CkptShardedMetadata': (None, None),
        'get_default_load_sharded_strategy': (('checkpoint_dir',), ('checkpoint_dir',)),
        'get_default_save_common_strategy': (('backend', 'version'), NO),
        'get_default_save_sharded_strategy': (('backend', 'version'), ('backend',)),
        'load': (('sharded_state_dict', 'checkpoint_dir', 'sharded_strategy', 'common_strategy', 'validate_access_integrity', 'strict'), ('sharded_state_dict', 'checkpoint_dir', 'sharded_strategy', 'validate_access_integrity', 'strict', 'verify_integrity', 'process_group')),
        'load_common_state_dict': (('checkpoint_dir',), ('checkpoint_dir',)),
        'load_content_metadata': (('checkpoint_dir',), ('checkpoint_dir',)),
        'load_plain_tensors': (('checkpoint_dir',), ('checkpoint_dir',)),
        'load_sharded_metadata': (('checkpoint_dir', 'sharded_strategy', 'common_strategy'), ('checkpoint_dir', 'sharded_strategy')),
        'load_tensors_metadata': (('checkpoint_dir', 'sharded_strategy'), ('checkpoint_dir', 'sharded_strategy')),
        'logger': (None, None),
        'remove_sharded_tensors': (('checkpoint_dir', 'key_prefix'), ('checkpoint_dir', 'key_prefix')),
        'save': (('sharded_state_dict', 'checkpoint_dir', 'sharded_strategy', 'common_strategy', 'validate_access_integrity', 'async_sharded_save', 'preprocess_common_before_consistancy_check', 'content_metadata'), ('sharded_state_dict', 'checkpoint_dir', 'sharded_strategy', 'validate_access_integrity', 'async_sharded_save', 'preprocess_common_before_consistancy_check', 'content_metadata', 'async_strategy', 'verify_integrity')),
    },
    'state_dict_utils': {
        'filter_out_empty_flatten_tensor': (('sharded_state_dict',), ('sharded_state_dict',)),
        'load_preprocess': (('sharded_state_dict',), ('sharded_state_dict',)),
        'save_preprocess': (('sharded_state_dict', 'validate_access_integrity', 'preprocess_common_before_consistancy_check'), ('sharded_state_dict', 'validate_access_integrity', 'preprocess_common_before_consistancy_check')),
    },
    'strategies': {
        'register_default_common_strategies': (None, NO),
    },
    'tensor_aware_state_dict': {
        'MCoreTensorAwareStateDict': (None, None),
        'logger': (None, None),
    },
    'utils': {
        'add_prefix_for_sharding': (('sharded_state_dict', 'prefix'), ('sharded_state_dict', 'prefix')),
        'apply_prefix_mapping': (('sharded_state_dict', 'prefix_map'), ('sharded_state_dict', 'prefix_map')),
        'debug_msg': (('msg',), ('msg',)),
        'debug_time': (('name', 'logger', 'threshold', 'level'), ('name', 'logger', 'threshold', 'level')),
        'extract_nonpersistent': (('sharded_state_dict',), ('sharded_state_dict',)),
        'extract_sharded_base': (('sharded_state_dict',), ('sharded_state_dict',)),
        'extract_sharded_tensors': (('sharded_state_dict',), ('sharded_state_dict',)),
        'extract_sharded_tensors_and_factories': (('sharded_state_dict',), ('sharded_state_dict',)),
        'extract_sharded_tensors_or_nonpersistent': (('sharded_state_dict',), ('sharded_state_dict',)),
        'fallback_logger': (None, None),
        'force_all_tensors_to_non_fp8': (NO, ('sharded_state_dict',)),
        'logger_stack': (('name', 'current_logger'), ('name', 'current_logger')),
        'replace_prefix_for_sharding': (('sharded_state_dict', 'old_prefix', 'new_prefix'), ('sharded_state_dict', 'old_prefix', 'new_prefix')),
        'zip_strict': ((), ()),
    },
    'validation': {
        'INTEGRITY_FNAME': (NO, None),
        'StrictHandling': (None, None),
        'adjust_non_strict_load': (('sharded_state_dict', 'sharded_keys_to_remove'), ('sharded_state_dict', 'sharded_keys_to_remove')),
        'determine_global_metadata': (('sharded_state_dict',), ('sharded_state_dict', 'process_group')),
        'logger': (None, None),
        'maybe_report_missing_and_unexpected_keys': (('missing_keys', 'unexpected_keys', 'raise_error'), ('missing_keys', 'unexpected_keys', 'raise_error')),
        'parse_strict_flag': (('strict',), ('strict',)),
        'save_integrity_manifest': (NO, ('checkpoint_dir',)),
        'validate_integrity_and_strict_load': (('sharded_state_dict', 'strict', 'validate_access_integrity', 'local_metadata', 'global_metadata', 'ckpt_sharded_metadata'), ('sharded_state_dict', 'strict', 'validate_access_integrity', 'local_metadata', 'global_metadata', 'ckpt_sharded_metadata')),
        'validate_sharded_objects_handling': (('sharded_strategy', 'common_strategy'), NO),
        'validate_sharding_integrity': (('global_metadata', 'common_state_dict'), ('global_metadata', 'common_state_dict')),
        'verify_checkpoint': (NO, ('checkpoint_dir',)),
        'verify_checkpoint_and_load_strategy': (('checkpoint_dir', 'sharded_strategy', 'common_strategy'), NO),
        'verify_integrity_manifest': (NO, ('checkpoint_dir',)),
    },
    'strategies.async_utils': {
        'AsyncCaller': (None, None),
        'AsyncCallsQueue': (('persistent',), ('persistent',)),
        'AsyncRequest': (None, None),
        'PersistentAsyncCaller': ((), ()),
        'TemporalAsyncCaller': ((), ()),
        'logger': (None, None),
    },
    'strategies.base': {
        'AsyncSaveShardedStrategy': (None, NO),
        'LoadCommonStrategy': (None, NO),
        'LoadShardedStrategy': (None, NO),
        'LoadStrategyBase': (None, NO),
        'SaveCommonStrategy': (None, NO),
        'SaveShardedStrategy': (None, NO),
        'SaveStrategyBase': (('backend', 'version'), NO),
        'StrategyAction': (None, NO),
        'async_calls': (None, NO),
        'default_strategies': (None, NO),
        'get_default_strategy': (('action', 'backend', 'version'), NO),
        'register_default_strategy': (('action', 'backend', 'version', 'strategy'), NO),
    },
    'strategies.cached_metadata_filesystem_reader': {
        'CachedMetadataFileSystemReader': (('path',), ('path', 'cache_metadata')),
    },
    'strategies.checkpointable': {
        'CheckpointableShardedTensor': (NO, ('data', 'sh_ten')),
        'LocalShardsContainer': (NO, ('local_shards',)),
    },
    'strategies.common': {
        'COMMON_STATE_FNAME': (None, None),
        'TorchCommonLoadStrategy': (None, NO),
        'TorchCommonSaveStrategy': (None, NO),
        'load_common': (NO, ('checkpoint_dir',)),
        'logger': (None, None),
        'register_default_common_strategies': ((), NO),
        'save_common': (NO, ('common_state_dict', 'checkpoint_dir')),
    },
    'strategies.filesystem_async': {
        'FileSystemWriterAsync': (('path',), ('path',)),
        'WriteBucket': (None, None),
        'get_write_results_queue': (NO, ('mp_mode',)),
        'logger': (None, None),
    },
    'strategies.fully_parallel': {
        'FullyParallelLoadStrategyWrapper': (('strategy', 'parallelization_group', 'do_cache_distribution', 'exchange_algo'), ('strategy', 'parallelization_group', 'do_cache_distribution', 'exchange_algo')),
        'FullyParallelSaveStrategyWrapper': (('strategy', 'parallelization_group', 'do_cache_distribution'), ('strategy', 'parallelization_group', 'do_cache_distribution', 'backend', 'version')),
        'T': (None, None),
        'distribute_main_replicas_with_precomputed_distribution': (('sharded_state_dict', 'parallelization_group', 'precomputed_distribution'), ('sharded_state_dict', 'parallelization_group', 'precomputed_distribution')),
        'logger': (None, None),
    },
    'strategies.nvrx': {
        'NVRX_MIN_VERSION': (NO, None),
        'has_nvrx_async_support': (NO, ()),
        'is_nvrx_min_version': (NO, ('version',)),
        'make_nvrx_async_request': (NO, ('async_request_cls', 'async_fn', 'async_fn_args', 'finalize_fns', 'async_fn_kwargs', 'preload_fn')),
    },
    'strategies.resharding': {
        'ReformulationRestoreMetadata': (None, NO),
        'TensorReformulationMetadata': (None, NO),
        'apply_nd_flattened_tensors_reformulation': (('sharded_state_dict', 'reformulation_metadata'), NO),
        'is_nd_flattened_tensor': (('sh_ten',), NO),
        'logger': (None, NO),
        'nd_flattened_tensor_reformulated_global_shape': (('sh_ten',), NO),
        'reformulate_single_nd_flattened_tensor': (('sh_ten', 'reformulation_metadata'), NO),
        'restore_nd_flattened_tensors_formulation': (('state_dict', 'formulation_restore_metadata'), NO),
    },
    'strategies.state_dict_saver': {
        'logger': (None, None),
        'save_state_dict_async_finalize': (('storage_writer', 'global_metadata', 'dist_wrapper'), ('storage_writer', 'global_metadata', 'dist_wrapper')),
        'save_state_dict_async_plan': (('state_dict', 'storage_writer', 'process_group', 'coordinator_rank', 'planner', 'cached_ckpt_structure', 'loaded_all_plans'), ('state_dict', 'storage_writer', 'process_group', 'coordinator_rank', 'planner', 'cached_ckpt_structure', 'loaded_all_plans')),
        'verify_global_md_reuse': (('loaded_all_plans', 'local_plan', 'rank', 'dist_wrapper'), ('loaded_all_plans', 'local_plan', 'rank', 'dist_wrapper')),
    },
    'strategies.torch': {
        'HAVE_NVRX': (NO, None),
        'MCoreLoadPlanner': ((), ()),
        'MCoreMetadata': (NO, None),
        'MCoreSavePlan': (None, None),
        'MCoreSavePlanner': ((), ()),
        'MSC_PREFIX': (None, None),
        'TorchDistLoadShardedStrategy': ((), ('cache_metadata', 'stream_ckpt_dequant', 'checkpoint_name')),
        'TorchDistSaveShardedStrategy': (('backend', 'version', 'keep_only_main_replica', 'thread_count', 'cached_metadata', 'separation_hint'), ('backend', 'version', 'keep_only_main_replica', 'thread_count', 'cached_metadata', 'separation_hint', 'cpu_shm_mode')),
        'flatten_state_dict': (('state_dict',), ('state_dict',)),
        'get_async_strategy': (NO, ('async_strategy', 'module')),
        'get_reformulation_metadata': (('sharded_state_dict', 'checkpoint_dir'), NO),
        'logger': (None, None),
        'mcore_to_pyt_state_dict': (('state_dict', 'is_loading', 'init_device', 'load_legacy_1d_flatten_tensors'), ('state_dict', 'is_loading', 'init_device', 'load_legacy_1d_flatten_tensors')),
        'register_default_torch_strategies': ((), NO),
        'sharded_tensor_to_torch_sharded_tensor': (('sh_tens', 'rank', 'load_legacy_1d_flatten_tensors'), ('sh_tens', 'rank', 'load_legacy_1d_flatten_tensors')),
    },
}  # fmt: skip

# 0.19 dropped ``common_strategy`` from ``save``/``load``'s positions; we keep 0.13's
# order (``common_strategy`` 4th) and take 0.19's later parameters by keyword.
CONFLICTS = {("serialization", "save", "0.19.2"), ("serialization", "load", "0.19.2")}

CASES = [
    (module, name, release, params)
    for module, names in MEGATRON_NAMES.items()
    for name, per_release in names.items()
    for release, params in zip(("0.13.1", "0.19.2"), per_release)
    if params != NO
]


def _positional(obj: object) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    names = [
        p.name
        for p in inspect.signature(target).parameters.values()  # type: ignore[arg-type]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return names[1:] if inspect.isclass(obj) and names[:1] == ["self"] else names


@pytest.mark.parametrize(
    ("module", "name", "release", "params"),
    CASES,
    ids=[f"{r}:{m or 'dist_checkpointing'}.{n}" for m, n, r, _ in CASES],
)
def test_megatron_name_exists_with_compatible_signature(
    module: str, name: str, release: str, params: tuple[str, ...] | None
) -> None:
    mod = importlib.import_module("dist_checkpointing" + (f".{module}" if module else ""))
    obj = getattr(mod, name)
    if params is None or (module, name, release) in CONFLICTS:
        return
    positional = _positional(obj)
    assert positional[: len(params)] == list(params), (module, name, positional)


def test_the_table_counts_every_name() -> None:
    per_release = {
        r: sum(1 for names in MEGATRON_NAMES.values() for v in names.values() if v[i] != NO)
        for i, r in enumerate(("0.13.1", "0.19.2"))
    }
    assert per_release == {"0.13.1": 157, "0.19.2": 150}


def test_conflicting_orders_take_the_newer_parameters_by_keyword() -> None:
    from dist_checkpointing import serialization

    for fn in (serialization.save, serialization.load):
        params = inspect.signature(fn).parameters
        assert {"verify_integrity", "process_group"} <= set(params)
    assert "async_strategy" in inspect.signature(serialization.save).parameters
