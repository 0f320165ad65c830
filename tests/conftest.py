import os
import tempfile

import pytest

# One embedded-corpus cache per test session (built once, ~15 s), never the user's ~/.cache.
os.environ.setdefault("MEGALITE_CACHE", tempfile.mkdtemp(prefix="megalite-cache-"))

# The slowest end-to-end tests (over ~10 s each on 2 cores): `python -m pytest -m "not slow and not gpu"`
# leaves them out for a fast loop while working; CI runs everything.
SLOW = {
    "test_bert_data.py::test_default_bert_run_trains_on_the_embedded_corpus",
    "test_bert_data.py::test_bert_trains_to_the_same_losses_in_every_layout",
    "test_cli_gpt.py::test_default_run_trains_on_the_embedded_corpus",
    "test_cli_gpt.py::test_layouts_give_the_single_device_losses",
    "test_checkpoint.py::test_reshard_to_other_layouts_continues_the_unbroken_run",
    "test_checkpoint.py::test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_intact",
    "test_checkpoint.py::test_resume_is_bitwise_exact",
    "test_multinode.py::test_a_partitioned_host_times_out",
    "test_multinode.py::test_a_host_that_dies_ends_the_job_and_leaves_a_loadable_checkpoint",
    "test_multinode.py::test_sbatch_on_two_slurm_nodes_trains_like_one_process",
    "test_sequence_parallel.py::test_sequence_parallel_trains_like_tensor_parallel_alone",
    "test_optim.py::test_bf16_loss_curve_tracks_fp32",
    "test_launch.py::test_a_signal_to_the_launcher_saves_and_exits_zero",
    "test_convert_hf_llama.py::test_import_at_other_layouts_matches_hf",
    "test_convert_hf_llama.py::test_export_after_training_at_tp2_pp2_reloads_with_megalites_logits",
    "test_llama.py::test_llama_tiny_trains_to_the_single_device_losses_in_every_layout",
    "test_llama.py::test_a_tp2_llama_checkpoint_resumes_at_tp4_and_tp1",
    "test_llama.py::test_llama_tiny_trains_on_the_embedded_corpus_with_no_other_flag",
    "test_zero.py::test_every_zero_stage_trains_like_plain_data_parallelism",
    "test_zero.py::test_stage_3_gather_options_train_the_same_through_interleaved_pipelines",
    "test_zero.py::test_zero_stages_keep_mixed_precision_training_with_tied_embeddings_across_stages",
    "test_context_parallel.py::test_four_dimensional_layouts_on_8_ranks_equal_one_device",
    "test_local_sgd.py::test_resume_is_bitwise_exact_mid_round_and_at_a_round_boundary",
    "test_local_sgd.py::test_h1_with_a_plain_outer_step_equals_data_parallelism",
    "test_slow_links.py::test_data_parallel_training_across_the_throttled_link_equals_one_process",
}


# Tests that use machine-wide things (network namespaces and their lock, the local Slurm): under
# `-n 2 --dist loadgroup` one pytest-xdist worker runs them all, one after another. So does each
# module's tests that share a module fixture.
MACHINE_WIDE = {"test_multinode.py", "test_slurm.py", "test_slow_links.py"}


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return any(defs and defs[-1].scope == "module" for defs in (info.name2fixturedefs.values() if info else ()))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns the groups into the nodeids' "@group"
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("/")[-1].split("::")[0]
        if module in MACHINE_WIDE:
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif _uses_a_module_fixture(item):
            # A module fixture (one spawn of ranks shared by an equality matrix's cases) runs once per
            # worker that runs one of its tests: its tests on one worker, or both workers pay for it.
            item.add_marker(pytest.mark.xdist_group(f"fixture:{module}"))
        if item.nodeid.split("/")[-1].split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
