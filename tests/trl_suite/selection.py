"""The tests of TRL's GRPO test file that CI runs, stock and drop-in (about 3 minutes for both on 2 CPU cores):
the loss and every loss type, the old / reference log-probs, PEFT (LoRA, a saved lm_head, a PEFT model), gradient
accumulation, several iterations per generation, the KL, the entropy controls, clipping and importance sampling."""

TEST_CLASS = "TestGRPOTrainer::"
LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

CI: tuple[str, ...] = tuple(
    TEST_CLASS + name
    for name in (
        "test_init_minimal",
        "test_train[trl-internal-testing/tiny-Qwen2ForCausalLM-2.5]",
        "test_train[trl-internal-testing/tiny-Qwen3MoeForCausalLM]",  # the MoE load-balancing loss
        "test_train[trl-internal-testing/tiny-GptOssForCausalLM]",
        *(f"test_train_loss_types[{loss_type}-False]" for loss_type in LOSS_TYPES),
        "test_train_multiple_iterations",  # old log-probs
        "test_train_beta_non_zero",  # reference log-probs and the KL
        "test_train_with_sync_ref_model",
        "test_train_with_bias_correction_kl[False]",
        "test_train_peft_config",
        "test_train_peft_model",
        "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed",  # a saved lm_head under PEFT
        "test_train_with_off_policy_mask",
        "test_train_delta_clipping[False]",
        "test_train_sequence_importance_sampling",
        "test_train_with_entropy_filter",  # top_entropy_quantile
        "test_train_with_adaptive_entropy_gradient_accumulation",
        "test_train_num_generations_larger_than_batch_size",  # gradient accumulation over a generation
        "test_train_with_cast_lm_head_to_fp32[trl-internal-testing/tiny-Qwen3ForCausalLM]",
        "test_train_with_cast_lm_head_to_fp32[trl-internal-testing/tiny-Gemma2ForCausalLM]",  # tied embeddings
    )
)
