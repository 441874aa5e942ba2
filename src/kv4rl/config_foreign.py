"""Other frameworks' key names (TRL's GRPOConfig, verl's GRPO and DAPO configs) and what kv4rl calls them.

The config loader refuses an unknown key; where the key is one of these, the error names the kv4rl key it
means, or says the feature does not exist, instead of listing the known keys. README's "Coming from verl" and
"Coming from TRL" tables list the same names (tests/test_config.py checks every one of them gets a pointer).
"""

from kv4rl.config_foreign_others import AREAL, SLIME_OPENRLHF_PRIMERL

# Other frameworks' key names (TRL's GRPOConfig, verl's GRPO config) -> what kv4rl calls them: a pasted name
# is refused with its kv4rl key, not a look-alike (`beta` pointed to algo.beta, future_kl's cost).
OTHER_FRAMEWORKS = {
    "beta": "TRL's beta (the reference-KL coefficient) is algo.kl_ref_coef; algo.beta is future_kl's future-KL cost",
    "kl_loss_coef": "verl's and slime's kl_loss_coef (with their use_kl_loss) is algo.kl_ref_coef",
    "use_kl_loss": "verl's use_kl_loss is algo.kl_ref_coef > 0",
    "num_generations": "TRL's num_generations is rollout.group_size (num_generations_eval is eval.k)",
    "num_generations_eval": "TRL's num_generations_eval is eval.k",
    "learning_rate": "the learning rate is trainer.lr",
    "epsilon": "TRL's epsilon is algo.eps_low (and algo.eps_high, which it also sets)",
    "epsilon_high": "TRL's epsilon_high is algo.eps_high (with loss_type cispo: algo.cispo_max, under "
                    "algo.surrogate=cispo)",
    "clip_ratio": "verl's clip_ratio is algo.eps_low and algo.eps_high",
    "loss_type": "TRL's loss_type is algo.loss_agg (dapo: token_mean, grpo: seq_mean, dr_grpo: token_sum_norm; cispo: "
                 "token_mean with algo.surrogate=cispo, sapo: seq_mean with algo.surrogate=sapo, vespo: token_mean "
                 "with algo.surrogate=vespo; luspo: seq_mean_token_sum with algo.ratio_level=sequence)",
    "loss_agg_mode": "verl's loss_agg_mode is algo.loss_agg (token-mean: token_mean, seq-mean-token-mean: seq_mean, "
                     "seq-mean-token-sum-norm: token_sum_norm, seq-mean-token-sum: seq_mean_token_sum)",
    "num_iterations": "TRL's num_iterations is trainer.epochs_per_batch (with algo.old_logprob=recompute)",
    "ppo_epochs": "verl's ppo_epochs is trainer.epochs_per_batch",
    "max_completion_length": "TRL's max_completion_length is rollout.max_new_tokens",
    "max_response_length": "verl's max_response_length is rollout.max_new_tokens",
    "scale_rewards": "TRL's scale_rewards is advantage.normalize_std and advantage.std_scope (group: true; batch: true "
                     "with std_scope=batch; none: false)",
    "reward_funcs": "TRL's reward_funcs are reward.name (the verifier, which accuracy reads) and reward.extra",
    "reward_weights": "TRL's reward_weights are reward.weights (reward.name's first)",
    "lr_scheduler_type": "the schedule is trainer.lr_schedule (constant, linear or cosine)",
    "warmup_ratio": "the warm-up is trainer.warmup_iters, in iterations",
    "lr_warmup_steps": "the warm-up is trainer.warmup_iters, in iterations",
    "train_batch_size": "verl's train_batch_size (prompts per step) is rollout.quota_groups; OpenRLHF's (samples "
                        "per optimizer step) is trainer.updates_per_batch = rollout_batch_size x n_samples_per_prompt "
                        "/ train_batch_size",
    "delta": "TRL's delta is algo.dual_clip",
    "warmup_steps": "the warm-up is trainer.warmup_iters, in iterations",
    "lr_warmup_steps_ratio": "the warm-up is trainer.warmup_iters, in iterations",
    "warmup_style": "the schedule is trainer.lr_schedule (constant, linear or cosine)",
    "per_device_train_batch_size": "TRL's per_device_train_batch_size (completions) is trainer.micro_batch_size; "
                                   "the prompts per iteration are rollout.quota_groups",
    "generation_batch_size": "TRL's generation_batch_size (completions) is rollout.quota_groups x rollout.group_size",
    "steps_per_generation": "TRL's steps_per_generation / gradient_accumulation_steps (optimizer steps per "
                            "generation) is trainer.updates_per_batch",
    "optim": "verl's optim keys are trainer.lr, trainer.weight_decay, trainer.warmup_iters, trainer.lr_schedule "
             "and trainer.min_lr_ratio",
    "n": "verl's rollout.n is rollout.group_size (its val_kwargs.n, samples per evaluated problem, is eval.k)",
    "grad_clip": "verl's actor.grad_clip is trainer.grad_clip",
    "ppo_mini_batch_size": "verl's ppo_mini_batch_size is trainer.updates_per_batch, a count of optimizer steps "
                           "(train_batch_size / ppo_mini_batch_size)",
    "ppo_micro_batch_size_per_gpu": "verl's ppo_micro_batch_size_per_gpu is trainer.micro_batch_size",
    "ppo_micro_batch_size": "verl's ppo_micro_batch_size is trainer.micro_batch_size (rows per rank)",
    "use_dynamic_bsz": "verl's use_dynamic_bsz is trainer.max_tokens_per_micro_batch (packed rows)",
    "ppo_max_token_len_per_gpu": "verl's ppo_max_token_len_per_gpu is trainer.max_tokens_per_micro_batch",
    "clip_ratio_low": "verl's clip_ratio_low is algo.eps_low",
    "clip_ratio_high": "verl's clip_ratio_high is algo.eps_high",
    "clip_ratio_c": "verl's clip_ratio_c is algo.dual_clip (off by default here; 3.0 is verl's)",
    "kl_loss_type": "verl's kl_loss_type is algo.kl_ref_type (low_var_kl: k3 with algo.kl_ref_clamp=10, kl: k1, "
                    "mse: k2, abs)",
    "entropy_coeff": "verl's entropy_coeff is algo.entropy_coeff",
    "norm_adv_by_std_in_grpo": "verl's norm_adv_by_std_in_grpo is advantage.normalize_std",
    "adv_estimator": "verl's adv_estimator is advantage.estimator (grpo, rloo, reinforce_plus_plus_baseline, "
                     "reinforce_plus_plus, opo, grpo_passk, gpg, remax or optimal_token_baseline)",
    "total_epochs": "verl's total_epochs is trainer.iterations (iterations, computed by hand)",
    "total_training_steps": "verl's total_training_steps is trainer.iterations",
    "gpu_memory_utilization": "verl's gpu_memory_utilization is engine.gpu_memory_fraction (a share of the whole "
                              "device, the colocated learner's memory included)",
    "tensor_model_parallel_size": "verl's rollout.tensor_model_parallel_size is engine.tensor_parallel; slime's "
                                  "(Megatron's, the learner's) has no counterpart: the learner is FSDP2 over the "
                                  "ranks (trainer.fsdp)",
    "quantization": "verl's rollout.quantization (vLLM's fp8 weights) is engine.weight_format=fp8; the KV cache's "
                    "format is engine.kv.format",
    "kv_cache_dtype": "vLLM's and SGLang's kv_cache_dtype (fp8, fp8_e4m3) is engine.kv.format (bf16, fp8, int4, kv4, "
                      "nvfp4, mxfp4)",
    "save_freq": "verl's save_freq is checkpoint.save_every (>= 1; a checkpoint is also written at the end and on a "
                 "stop, so verl's -1, never, has no counterpart)",
    "test_freq": "verl's test_freq is eval.every (verl's -1, no evaluation, is 0)",
    "val_before_train": "verl's val_before_train is eval.before_training (off by default here)",
    "max_prompt_length": "verl's max_prompt_length with filter_overlong_prompts is data.max_prompt_tokens (the longer "
                         "rows are dropped; verl's truncation does not exist)",
    "filter_overlong_prompts": "verl's filter_overlong_prompts is data.max_prompt_tokens (the length; longer rows are "
                               "dropped)",
    "filter_groups": "verl's filter_groups (DAPO's dynamic sampling) is rollout.filter_groups",
    "max_num_gen_batches": "verl's filter_groups.max_num_gen_batches is rollout.filter_max_batches",
    "overlong_buffer": "verl's overlong_buffer (DAPO's overlong reward shaping) is reward.overlong_buffer (its len) and "
                       "reward.overlong_penalty (its penalty_factor)",
    "penalty_factor": "verl's overlong_buffer.penalty_factor is reward.overlong_penalty",
    "overlong_buffer.len": "verl's overlong_buffer.len is reward.overlong_buffer",
    "overlong_buffer.enable": "verl's overlong_buffer.enable is reward.overlong_buffer > 0 (0 turns it off)",
    "overlong_buffer.log": "verl's overlong_buffer.log has no key here: the penalty is always logged "
                           "(rewards/overlong/mean)",
    # DAPO's scripts write them under reward_kwargs, as overlong_buffer_cfg
    "overlong_buffer_cfg.len": "verl's overlong_buffer_cfg.len is reward.overlong_buffer",
    "overlong_buffer_cfg.enable": "verl's overlong_buffer_cfg.enable is reward.overlong_buffer > 0 (0 turns it off)",
    "overlong_buffer_cfg.log": "verl's overlong_buffer_cfg.log has no key here: the penalty is always logged "
                               "(rewards/overlong/mean)",
    "reward_kwargs.max_resp_len": "verl's reward_kwargs.max_resp_len (what DAPO's overlong buffer counts back from) "
                                  "is rollout.max_new_tokens here",
    "ref.fsdp_config.param_offload": "verl's ref.fsdp_config.param_offload has no counterpart: the reference "
                                     "policy stays whole on the GPU (trainer.offload offloads the trained policy "
                                     "only); with algo.kl_ref_coef=0 and trainer.ref_kl_every=0 it is not loaded",
    "actor_rollout_ref.rollout.mode": "verl's rollout.mode (sync: its engine's LLM API, async: AsyncLLM) has no "
                                      "counterpart; kv4rl's rollout.mode is another setting (partial: unfinished "
                                      "responses carried across updates), and its default sync matches verl's",
    "rollout.tensor_model_parallel_size": "verl's rollout.tensor_model_parallel_size is engine.tensor_parallel",
    "calculate_sum_pi_squared": "verl's actor.calculate_sum_pi_squared needs no key: "
                                "advantage.estimator=optimal_token_baseline computes Σπ² itself",
    "enable_chunked_prefill": "verl's enable_chunked_prefill is engine.chunked_prefill (on by default)",
    "mask_truncated_completions": "TRL's mask_truncated_completions is trainer.mask_truncated",
    "importance_sampling_level": "TRL's importance_sampling_level is algo.ratio_level (token or sequence, GSPO's)",
    "top_entropy_quantile": "TRL's top_entropy_quantile is algo.top_entropy_quantile",
    "entropy_coef": "TRL's and slime's entropy_coef is algo.entropy_coeff (aggregated by algo.loss_agg; TRL's token mean is "
                    "algo.loss_agg=token_mean)",
    "off_policy_mask_threshold": "TRL's off_policy_mask_threshold is algo.off_policy_mask",
    "use_bias_correction_kl": "TRL's use_bias_correction_kl is algo.kl_ref_unbiased",
    "train_files": "verl's data.train_files is data.train (a file or a list of files: verl's Parquet as it is, or "
                   "JSONL of {problem, answer} rows)",
    "val_files": "verl's data.val_files is data.eval (a file or a list of files: verl's Parquet as it is, or JSONL "
                 "of {problem, answer} rows)",
    "enable_gradient_checkpointing": "verl's enable_gradient_checkpointing is trainer.grad_checkpointing",
    "param_offload": "verl's fsdp_config.param_offload is trainer.offload (FSDP2 CPU offload; "
                     "trainer.offload_optimizer keeps only AdamW's moments on the CPU)",
    "optimizer_offload": "verl's fsdp_config.optimizer_offload is trainer.offload_optimizer",
    "logger": "verl's trainer.logger: TensorBoard event files are always written; logging.wandb=true adds W&B",
    "project_name": "verl's trainer.project_name is logging.wandb_project",
    "experiment_name": "verl's trainer.experiment_name and AReaL's experiment_name are name (the run folder is "
                       "out_dir/name)",
    "n_gpus_per_node": "verl's n_gpus_per_node is torchrun's --nproc-per-node (README, 'Several GPUs: torchrun')",
    "nnodes": "verl's nnodes is torchrun's --nnodes (README, 'Several GPUs: torchrun')",
    "use_kl_in_reward": "verl's use_kl_in_reward with kl_ctrl.kl_coef (0.001 by default there) is "
                        "advantage.kl_reward_coef > 0 (kl_ctrl.type: advantage.kl_reward_control)",
    "kl_ctrl.type": "verl's kl_ctrl.type (fixed, adaptive) is advantage.kl_reward_control, with "
                    "advantage.kl_reward_coef > 0 as its start",
    "target_kl": "verl's kl_ctrl.target_kl (0.1) is advantage.kl_reward_target (with "
                 "advantage.kl_reward_control=adaptive)",
    "horizon": "verl's kl_ctrl.horizon (10000) is advantage.kl_reward_horizon (with "
               "advantage.kl_reward_control=adaptive)",
    **dict.fromkeys(("custom_reward_function.path", "custom_reward_function.name"),
                    "verl's custom_reward_function is a plug-in module (algo.plugins) that registers "
                    "VerlScore(compute_score) as a reward, named by reward.name (README, 'A verl reward function')"),
    "loss_mode": "verl's policy_loss.loss_mode: vanilla is kv4rl's default (algo.loss=ppo_clip); gspo is "
                 "algo.ratio_level=sequence with algo.loss_agg=seq_mean; sapo is algo.surrogate=sapo with "
                 "algo.loss_agg=seq_mean (verl forces it); gpg is algo.surrogate=pg; cispo is algo.surrogate=cispo "
                 "with algo.cispo_max = 1 + clip_ratio_high (verl also holds the weight at 1 - clip_ratio_low from "
                 "below, kv4rl's does not); geo_mean, clip_cov and kl_cov do not exist",
    "default_local_dir": "verl's trainer.default_local_dir is out_dir (the run folder is out_dir/name)",
    "max_actor_ckpt_to_keep": "verl's max_actor_ckpt_to_keep is checkpoint.keep_last (2 by default here; verl's null, "
                              "keep every one, is checkpoint.keep_last=null)",
    "resume_mode": "verl's trainer.resume_mode is `kv4rl train --resume RUN_FOLDER` (its newest intact checkpoint; "
                   "without it a folder holding a run is refused)",
    "seed": "the run has one seed, the top-level seed (verl's data.seed, the shuffle's, among what it sets)",
    "clip_grad": "verl's optim.clip_grad and slime's clip_grad are trainer.grad_clip",
    "val_kwargs": "verl's val_kwargs are eval.temperature (verl's 0, greedy; 1.0 by default here), eval.k (its n); "
                  "top_p / top_k / do_sample have no eval counterpart (do_sample=false is eval.temperature=0)",
    "val_kwargs.temperature": "verl's val_kwargs.temperature (0 there: greedy) is eval.temperature (1.0 by default "
                              "here)",
    **dict.fromkeys(("val_kwargs.do_sample", "do_sample"),
                    "verl's val_kwargs.do_sample=false (its default: greedy) is eval.temperature=0"),
    "val_kwargs.n": "verl's val_kwargs.n is eval.k",
    **dict.fromkeys(("val_kwargs.top_p", "val_kwargs.top_k"),
                    "verl's val_kwargs.top_p / top_k have no counterpart: the evaluation samples the whole "
                    "distribution at eval.temperature"),
    "reward_model.reward_manager": "verl's reward_manager has no counterpart: a reward scores the whole batch "
                                   "(reward.name; VerlScore calls a verl compute_score per response, as verl's naive "
                                   "manager does)",
    "reward_manager": "verl's reward_manager has no counterpart: a reward scores the whole batch (reward.name; "
                      "VerlScore calls a verl compute_score per response, as verl's naive manager does)",
    "critic_warmup": "verl's trainer.critic_warmup has no counterpart: there is no critic (GAE does not exist); the "
                     "estimators are critic-free (advantage.estimator)",
    "kl_coef": "verl's kl_ctrl.kl_coef (0.001 by default there) and slime's kl_coef are advantage.kl_reward_coef "
               "(slime reads its kl_coef only with ppo and the reinforce estimators)",
    "kl_penalty": "verl's algorithm.kl_penalty is advantage.kl_reward_type (kl: k1, low_var_kl: k3, mse: k2, abs)",
    "rollout_is_batch_normalize": "verl's rollout_is_batch_normalize is algo.behavior_is_normalize (with "
                                  "algo.behavior_is)",
    "rollout_rs": "verl's rollout_correction.rollout_rs is algo.behavior_rs (the same options, e.g. token_k1 or "
                  "seq_mean_k3,seq_max_k2; algo.old_logprob=recompute is verl's decoupled mode)",
    "rollout_rs_threshold": "verl's rollout_rs_threshold is algo.behavior_rs_threshold (the same form; quote a "
                            "lower_upper pair such as '0.5_2' that YAML would read as a number)",
    "truncation": "verl's data.truncation does not exist: data.max_prompt_tokens drops the longer prompts",
    "model_name_or_path": "TRL's model_name_or_path is model.path (a local model folder; nothing is downloaded)",
    "gradient_accumulation_steps": "TRL's gradient_accumulation_steps has no key here: each optimizer step "
                                   "accumulates every micro-batch (trainer.micro_batch_size rows) of its "
                                   "mini-batch, the batch over trainer.updates_per_batch",
    "use_peft": "LoRA / PEFT does not exist here: the learner trains every weight in BF16",
    "min_p": "TRL's and vLLM's min_p is rollout.min_p",
    "repetition_penalty": "repetition_penalty does not exist (rollout.temperature, rollout.top_p, rollout.top_k)",
    "rollout_correction.loss_type": "verl's rollout_correction.loss_type is algo.surrogate with algo.old_logprob=behavior "
                                    "(ppo_clip: clip; reinforce with token rollout_is at c: cispo with algo.cispo_max=c; "
                                    "reinforce alone: pg)",
    "rollout.name": "verl's rollout.name (vllm / sglang) has no counterpart: kv4rl rolls out with its own engine "
                    "(engine.*); the reward's name is reward.name",
    "sapo_temperature_pos": "TRL's sapo_temperature_pos is algo.sapo_tau_pos (with algo.surrogate=sapo)",
    "sapo_temperature_neg": "TRL's sapo_temperature_neg is algo.sapo_tau_neg (with algo.surrogate=sapo)",
    # TRL's generation backends, reference sync and completion logging: kv4rl's engine and run folder instead
    **dict.fromkeys(("use_vllm", "vllm_mode", "vllm_model_impl", "vllm_server_base_url", "vllm_server_host",
                     "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "ds3_gather_for_generation",
                     "use_transformers_paged", "use_transformers_continuous_batching",
                     "transformers_continuous_batching_config", "cache_implementation"),
                    "TRL's generation backend settings have no counterpart: kv4rl samples with its own engine "
                    "(engine.*), in the training process or on its own ranks (rollout.placement=split)"),
    **dict.fromkeys(("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
                    "TRL's reference-model sync (TR-DPO) has no counterpart: the reference is the starting model"),
    **dict.fromkeys(("log_completions", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
                     "log_multimodal"),
                    "TRL's completion logging has no counterpart in training; kv4rl eval --samples writes responses"),
    "logging_steps": "every iteration writes one metrics row (metrics.jsonl, TensorBoard): TRL's logging_steps=1",
    "eval_strategy": "the periodic evaluation is eval.every (0: none)",
    "bf16": "the learner trains in BF16 on CUDA whatever is set; model.dtype is the engine's compute dtype",
    "generation_kwargs": "TRL's generation_kwargs are rollout.temperature, rollout.top_p, rollout.top_k, rollout.min_p "
                         "and rollout.max_new_tokens",
    "multi_objective_aggregation": "TRL's multi_objective_aggregation is reward.aggregation: sum_then_normalize "
                                   "(its default) is sum, normalize_then_sum (GDPO) is normalize_then_sum with "
                                   "advantage.std_scope=batch",
    "max_tool_calling_iterations": "tool calling (multi-turn rollouts) has no counterpart: one response per prompt",
    "model_init_kwargs": "TRL's model_init_kwargs have no counterpart: model.path's safetensors are read, the learner "
                         "trains in BF16 on CUDA and model.dtype is the engine's compute dtype",
    "trust_remote_code": "no remote code is run: kv4rl's own model code serves model_type qwen3, qwen2, llama and "
                         "mistral (model.path's config.json)",
    "router_aux_loss_coef": "mixture-of-experts models are not supported (model_type qwen3, qwen2, llama or mistral), "
                            "so TRL's router_aux_loss_coef has no counterpart",
    "disable_dropout": "kv4rl's decoder has no dropout: TRL's disable_dropout=true, nothing to set",
    "cast_lm_head_to_fp32": "TRL's cast_lm_head_to_fp32 has no counterpart: the LM head's product runs in the "
                            "learner's dtype (BF16 on CUDA), the log-softmax over its logits in float32",
    "remove_unused_columns": "a data file's other columns are kept in each problem's meta (a reward with "
                             "takes_problems reads them): nothing to set",
    "pad_to_multiple_of": "the learner packs or pads its micro-batches itself (trainer.max_tokens_per_micro_batch): "
                          "nothing to set",
    "chat_template_kwargs": "TRL's chat_template_kwargs have no counterpart: data.chat_template=true applies the "
                            "tokenizer's template to one user message with add_generation_prompt and its defaults",
    "vllm_structured_outputs_regex": "structured (regex-constrained) decoding has no counterpart",
    "use_adaptive_entropy": "TRL's use_adaptive_entropy is algo.entropy_target (set: adaptive; its entropy_target "
                            "0.2 is not the default here), starting from algo.entropy_coeff",
    "entropy_target": "TRL's entropy_target is algo.entropy_target (which also turns the control on)",
    "entropy_coef_delta": "TRL's entropy_coef_delta is algo.entropy_coeff_delta",
    "entropy_coef_min": "TRL's entropy_coef_min is algo.entropy_coeff_min",
    "entropy_coef_max": "TRL's entropy_coef_max is algo.entropy_coeff_max",
    "vllm_importance_sampling_correction": "TRL's vllm_importance_sampling_correction is algo.behavior_is (off unless "
                                           "set, with algo.old_logprob=recompute)",
    "vllm_importance_sampling_mode": "TRL's vllm_importance_sampling_mode is algo.behavior_is (token_truncate, "
                                     "token_mask, sequence_truncate or sequence_mask)",
    "vllm_importance_sampling_clip_max": "TRL's vllm_importance_sampling_clip_max is algo.behavior_is_max",
    "vllm_importance_sampling_cap": "TRL's vllm_importance_sampling_cap is algo.behavior_is_max",
    "vllm_importance_sampling_clip_min": "TRL's vllm_importance_sampling_clip_min is algo.behavior_is_min",
    "rollout_is": "verl's rollout_correction.rollout_is (token, sequence) is algo.behavior_is (token_truncate, "
                  "sequence_truncate), with algo.old_logprob=recompute",
    "rollout_is_threshold": "verl's rollout_is_threshold (2.0) is algo.behavior_is_max (3.0 by default here)",
    "bypass_mode": "verl's rollout_correction.bypass_mode=true (with ppo_clip) is algo.old_logprob=behavior, "
                   "kv4rl's default",
    "behav_imp_weight_cap": "AReaL's behav_imp_weight_cap (before March 2026) is algo.behavior_is_max with "
                            "algo.behavior_is=token_mask and algo.old_logprob=recompute (AReaL's default null is "
                            "algo.behavior_is_max=null; 3.0 here)",
    "use_decoupled_loss": "AReaL's decoupled PPO loss is algo.old_logprob=recompute; its π_prox/μ weight (AReaL's "
                          "rejection_sampling since April 2026, always on before) is algo.behavior_is=token_mask with "
                          "algo.behavior_is_max",
}


OTHER_FRAMEWORKS.update(SLIME_OPENRLHF_PRIMERL)
OTHER_FRAMEWORKS.update(AREAL)


# Other frameworks' values of a kv4rl key whose values differ: a pasted value is refused with the kv4rl one
OTHER_VALUES: dict[str, dict[str, str]] = {
    "advantage.estimator": {"grpo_vectorized": "grpo (verl's vectorized grpo computes the same)",
                            "rloo_vectorized": "rloo (verl's vectorized rloo computes the same)"},
    "algo.kl_ref_type": {"low_var_kl": "k3 (verl's low_var_kl; its cap at 10 is algo.kl_ref_clamp=10)",
                         "kl": "k1 (verl's kl)", "mse": "k2 (verl's mse)",
                         "k3+": "k2 (k3+'s gradient; verl's straight-through types do not exist here)",
                         "k1+": "k2 (k1+'s gradient; verl's straight-through types do not exist here)"},
    "advantage.kl_reward_type": {"kl": "k1 (verl's kl)", "low_var_kl": "k3 (verl's low_var_kl, without its cap of 10 a "
                                                                    "token)", "mse": "k2 (verl's mse)"},
    "algo.behavior_is": {"token": "token_truncate (verl's rollout_is: token)",
                         "sequence": "sequence_truncate (verl's rollout_is: sequence)"},
    "algo.loss_agg": {"token-mean": "token_mean (verl's token-mean)", "seq-mean-token-mean": "seq_mean (verl's)",
                      "seq-mean-token-sum": "seq_mean_token_sum (verl's)",
                      "seq-mean-token-sum-norm": "token_sum_norm (verl's seq-mean-token-sum-norm)",
                      "dapo": "token_mean (TRL's loss_type dapo)", "grpo": "seq_mean (TRL's loss_type grpo)",
                      "dr_grpo": "token_sum_norm (TRL's loss_type dr_grpo)",
                      "cispo": "token_mean (TRL's cispo divides so; its objective is algo.surrogate=cispo)",
                      "sapo": "seq_mean (TRL's sapo divides so; its objective is algo.surrogate=sapo)",
                      "bnpo": "token_mean (the nearest: TRL's bnpo divides by each process's tokens, token_mean by "
                              "the whole mini-batch's)",
                      "vespo": "token_mean (TRL's vespo divides so; its objective is algo.surrogate=vespo)",
                      "luspo": "seq_mean_token_sum with algo.ratio_level=sequence (TRL's luspo: GSPO's loss times "
                               "each response's length, over the responses)"},
}


# verl's sections of models kv4rl does not have: every key under one says so, before any key name in it that
# also names a policy key (critic.optim.lr is not trainer.lr; critic.ppo_epochs not trainer.epochs_per_batch)
NO_COUNTERPART_SECTIONS = {
    "critic": "a critic (verl's or AReaL's, the value model of GAE) has no counterpart: kv4rl's estimators are "
              "critic-free (advantage.estimator)",
    "reward_model": "verl's reward_model (a learned reward model) has no counterpart: rewards are rule-based "
                    "(reward.name, or a plug-in such as VerlScore)",
}


# what verl keeps in those sections that kv4rl does have: DAPO's overlong shaping, the reward manager
COUNTERPARTS_INSIDE = {"reward_model": ("overlong_buffer", "reward_manager", "reward_kwargs")}


def other_key_hint(key: str) -> str | None:
    """What kv4rl calls the pasted key `key` (dotted): an entry naming the end of its path (`rollout_correction.
    loss_type`) before one naming its last name (`loss_type`, TRL's), and a section without counterpart
    (`critic`) before any name inside it; or None."""
    names = key.replace("-", "_").split(".")  # slime's flags: eps-clip for eps_clip
    for start in range(len(names)):
        hint = OTHER_FRAMEWORKS.get(".".join(names[start:]))
        if hint is not None:
            return hint
        inside = names[start + 1] if start + 1 < len(names) else None
        if names[start] in NO_COUNTERPART_SECTIONS and inside not in COUNTERPARTS_INSIDE.get(names[start], ()):
            return NO_COUNTERPART_SECTIONS[names[start]]
    return None


def other_value_hint(key: str, value: object) -> str | None:
    """`key`'s kv4rl value meant by another framework's `value` (verl's or TRL's spelling), or None."""
    return OTHER_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
