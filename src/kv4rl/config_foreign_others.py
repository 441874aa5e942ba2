"""slime's, OpenRLHF's, prime-rl's and AReaL's key names and what kv4rl calls them (README's "Coming from slime,
OpenRLHF or prime-rl" and "Coming from AReaL"), read from their sources at the commits the README names; merged into
`config_foreign.OTHER_FRAMEWORKS`, which the config loader consults for an unknown key."""

# slime's (its flags with `_` for `-`: eps-clip=0.2 is read as eps_clip), OpenRLHF's and prime-rl's names
SLIME_OPENRLHF_PRIMERL = {
    "rollout_batch_size": "slime's and OpenRLHF's rollout_batch_size (prompts per rollout) is rollout.quota_groups",
    "n_samples_per_prompt": "slime's and OpenRLHF's n_samples_per_prompt is rollout.group_size",
    "global_batch_size": "slime's global_batch_size (samples per optimizer step) is trainer.updates_per_batch = "
                         "rollout_batch_size x n_samples_per_prompt / global_batch_size, a count of steps",
    "num_steps_per_rollout": "slime's num_steps_per_rollout is trainer.updates_per_batch",
    "num_rollout": "slime's num_rollout is trainer.iterations",
    "eps_clip": "slime's and OpenRLHF's eps_clip is algo.eps_low (and algo.eps_high, which it also sets)",
    "eps_clip_high": "slime's eps_clip_high is algo.eps_high",
    "eps_clip_c": "slime's eps_clip_c is algo.dual_clip",
    "eps_clip_low_high": "OpenRLHF's eps_clip_low_high is algo.eps_low and algo.eps_high",
    "use_unbiased_kl": "slime's use_unbiased_kl is algo.kl_ref_unbiased",
    **dict.fromkeys(("advantage_estimator", "algo.advantage.estimator"),
                    "OpenRLHF's advantage_estimator (gae by default there) is advantage.estimator (group_norm: grpo; "
                    "dr_grpo: grpo with advantage.normalize_std=false; rloo; reinforce_baseline: "
                    "reinforce_plus_plus_baseline; reinforce: reinforce_plus_plus; gae does not exist); slime's grpo, "
                    "reinforce_plus_plus and reinforce_plus_plus_baseline keep their names, its gspo is grpo with "
                    "algo.ratio_level=sequence, its cispo grpo with algo.surrogate=cispo, its ppo (GAE) does not exist"),
    **dict.fromkeys(("disable_grpo_std_normalization", "grpo_std_normalization"),
                    "slime's --disable-grpo-std-normalization is advantage.normalize_std=false"),
    "calculate_per_token_loss": "slime's calculate_per_token_loss=true is algo.loss_agg=token_mean; its default "
                                "(a mean per sample) is algo.loss_agg=seq_mean",
    "entropy_loss_coef": "OpenRLHF's entropy_loss_coef is algo.entropy_coeff",
    "use_tis": "slime's use_tis is algo.behavior_is=token_truncate with algo.old_logprob=recompute",
    "tis_clip": "slime's tis_clip (2.0) is algo.behavior_is_max (3.0 by default here)",
    "tis_clip_low": "slime's tis_clip_low is algo.behavior_is_min",
    "use_rollout_logprobs": "slime's use_rollout_logprobs=true is algo.old_logprob=behavior, kv4rl's default (slime's "
                            "default recomputes π_old: algo.old_logprob=recompute)",
    **dict.fromkeys(("use_opsm", "opsm_delta"),
                    "slime's OPSM (opsm_delta) is algo.off_policy_mask (kv4rl measures log μ − log π_θ, slime "
                    "log π_old − log π_θ)"),
    "dynamic_sampling_filter_path": "slime's dynamic sampling filter is rollout.filter_groups",
    "over_sampling_batch_size": "slime's over-sampling has no key here: rollout.filter_groups samples groups until "
                                "rollout.quota_groups are kept (at most rollout.filter_max_batches batches)",
    "partial_rollout": "slime's and OpenRLHF's partial_rollout is rollout.mode=partial (unfinished responses carried "
                       "over to the next batch, not recycled)",
    "rollout_max_response_len": "slime's rollout_max_response_len is rollout.max_new_tokens",
    "rollout_max_prompt_len": "slime's rollout_max_prompt_len is data.max_prompt_tokens",
    "rollout_temperature": "slime's rollout_temperature is rollout.temperature",
    "rollout_top_p": "slime's rollout_top_p is rollout.top_p",
    "rollout_top_k": "slime's rollout_top_k is rollout.top_k (off is 0 here, -1 in slime)",
    "rollout_shuffle": "slime's rollout_shuffle is data.shuffle (on by default here, off in slime)",
    "rollout_seed": "the run has one seed, the top-level seed",
    "update_weights_interval": "slime's update_weights_interval is staleness.refresh_every",
    "eval_interval": "slime's eval_interval is eval.every",
    "save_interval": "slime's save_interval is checkpoint.save_every",
    "n_samples_per_eval_prompt": "slime's n_samples_per_eval_prompt is eval.k",
    "eval_temperature": "slime's and OpenRLHF's eval_temperature is eval.temperature (OpenRLHF's default 0.6; 1.0 here)",
    "prompt_data": "slime's and OpenRLHF's prompt_data is data.train",
    "eval_prompt_data": "slime's eval_prompt_data is data.eval (a file or a list of files: give the paths)",
    **dict.fromkeys(("use_dynamic_batch_size", "max_tokens_per_gpu"),
                    "slime's dynamic batch size (max_tokens_per_gpu) is trainer.max_tokens_per_micro_batch"),
    "min_lr": "slime's and prime-rl's min_lr is trainer.min_lr_ratio, a ratio (min_lr / lr)",
    "lr_decay_style": "slime's lr_decay_style is trainer.lr_schedule (constant, linear or cosine)",
    "lr_warmup_iters": "slime's lr_warmup_iters is trainer.warmup_iters",
    # OpenRLHF (its dotted flags of 2026: train.batch_size, actor.eps_clip, algo.kl.init_coef, ...)
    "micro_train_batch_size": "OpenRLHF's micro_train_batch_size is trainer.micro_batch_size",
    "train.batch_size": "OpenRLHF's train.batch_size (samples per optimizer step) is trainer.updates_per_batch = "
                        "rollout.batch_size x n_samples_per_prompt / train.batch_size, a count of steps",
    "train.micro_batch_size": "OpenRLHF's train.micro_batch_size is trainer.micro_batch_size",
    "train.max_epochs": "OpenRLHF's train.max_epochs is trainer.epochs_per_batch",
    "train.num_episodes": "OpenRLHF's num_episodes has no key here: trainer.iterations counts iterations",
    "train.async_enable": "OpenRLHF's async training is staleness.lag (batches collected ahead of the learner)",
    "train.partial_rollout_enable": "OpenRLHF's partial rollout is rollout.mode=partial",
    "train.seed": "the run has one seed, the top-level seed",
    "actor_learning_rate": "OpenRLHF's actor_learning_rate is trainer.lr",
    "lr_warmup_ratio": "the warm-up is trainer.warmup_iters, in iterations",
    "lr_scheduler": "OpenRLHF's lr_scheduler is trainer.lr_schedule (cosine_with_min_lr: cosine with "
                    "trainer.min_lr_ratio)",
    **dict.fromkeys(("init_kl_coef", "kl.init_coef"),
                    "OpenRLHF's init_kl_coef (0.01 there) is advantage.kl_reward_coef, or with its use_kl_loss "
                    "algo.kl_ref_coef"),
    **dict.fromkeys(("kl_target", "kl.target"),
                    "OpenRLHF's kl_target is advantage.kl_reward_target with advantage.kl_reward_control=adaptive"),
    "kl_horizon": "OpenRLHF's kl_horizon is advantage.kl_reward_horizon",
    **dict.fromkeys(("kl_estimator", "kl.estimator"),
                    "OpenRLHF's and AReaL's kl_estimator is advantage.kl_reward_type (OpenRLHF's with its "
                    "use_kl_loss: algo.kl_ref_type; k1, k2, k3)"),
    "max_epochs": "OpenRLHF's max_epochs is trainer.epochs_per_batch",
    "num_episodes": "OpenRLHF's num_episodes has no key here: trainer.iterations counts iterations (computed by hand)",
    "eval_steps": "TRL's and OpenRLHF's eval_steps is eval.every (OpenRLHF's -1, never, is 0)",
    "save_steps": "TRL's and OpenRLHF's save_steps is checkpoint.save_every",
    **dict.fromkeys(("max_ckpt_num", "ckpt.max_num"), "OpenRLHF's max_ckpt_num is checkpoint.keep_last"),
    "eval_dataset": "OpenRLHF's eval_dataset is data.eval",
    "eval_n_samples_per_prompt": "OpenRLHF's eval_n_samples_per_prompt is eval.k",
    **dict.fromkeys(("dynamic_filtering", "algo.dynamic_filtering_enable"),
                    "OpenRLHF's dynamic filtering is rollout.filter_groups (for 0/1 rewards the same groups: OpenRLHF "
                    "keeps a group whose mean score is strictly inside (0, 1))"),
    # OpenRLHF's dotted flags of 2026 (ed62d0e2) whose last name alone would point elsewhere
    "eval.n_samples_per_prompt": "OpenRLHF's eval.n_samples_per_prompt is eval.k",
    "eval.steps": "OpenRLHF's eval.steps is eval.every (its -1, never, is 0)",
    "eval.dataset": "OpenRLHF's eval.dataset is data.eval",
    "data.prompt_dataset": "OpenRLHF's data.prompt_dataset is data.train",
    "rollout.batch_size": "OpenRLHF's rollout.batch_size (prompts per rollout) is rollout.quota_groups",
    "actor.entropy_coef": "OpenRLHF's actor.entropy_coef is algo.entropy_coeff",
    "algo.kl.use_loss": "OpenRLHF's algo.kl.use_loss puts its KL coefficient in the loss: algo.kl_ref_coef (without "
                        "it, in the reward: advantage.kl_reward_coef)",
    "algo.advantage.is_correction_enable": "OpenRLHF's IS correction is algo.behavior_is with "
                                           "algo.old_logprob=recompute",
    "algo.advantage.is_correction_type": "OpenRLHF's is_correction_type is algo.behavior_is (tis: token_truncate; "
                                         "icepop: token_mask)",
    "algo.advantage.is_correction_threshold": "OpenRLHF's is_correction_threshold is algo.behavior_is_min and "
                                              "algo.behavior_is_max",
    "enable_vllm_is_correction": "OpenRLHF's vLLM IS correction is algo.behavior_is with algo.old_logprob=recompute",
    "vllm_is_correction_type": "OpenRLHF's vllm_is_correction_type is algo.behavior_is (tis: token_truncate; icepop: "
                               "token_mask; seq-mask-tis at [low, high]: algo.behavior_rs=seq_mean_k1 with "
                               "algo.behavior_rs_threshold=<1/high>_<1/low> and algo.behavior_is=token_truncate "
                               "algo.behavior_is_max=null, whose masked responses leave the denominators here)",
    "vllm_is_truncated_threshold": "OpenRLHF's vllm_is_truncated_threshold is algo.behavior_is_min and "
                                   "algo.behavior_is_max",
    "policy_loss_type": "OpenRLHF's policy_loss_type=gspo is algo.ratio_level=sequence with algo.loss_agg=seq_mean",
    "async_train": "OpenRLHF's async_train is staleness.lag (batches collected ahead of the learner)",
    "max_norm": "OpenRLHF's and prime-rl's max_norm is trainer.grad_clip",
    "l2": "OpenRLHF's l2 is trainer.weight_decay",
    "adam_betas": "OpenRLHF's adam_betas is trainer.betas",
    "overlong_buffer_len": "OpenRLHF's overlong_buffer_len is reward.overlong_buffer",
    "overlong_penalty_factor": "OpenRLHF's and AReaL's overlong_penalty_factor is reward.overlong_penalty",
    # prime-rl
    "max_steps": "prime-rl's max_steps is trainer.iterations (TRL's counts optimizer steps: trainer.iterations x "
                 "trainer.updates_per_batch)",
    "max_off_policy_steps": "prime-rl's max_off_policy_steps is staleness.max_versions (with rollout.mode=partial; "
                            "prime-rl drops older rollouts, kv4rl samples them again)",
    **dict.fromkeys(("max_async_level", "async_level"),
                    "prime-rl's max_async_level (removed in May 2026: its trainer now runs one step ahead) is "
                    "staleness.lag (staleness.lag=1 for that fixed lag)"),
    "max_completion_tokens": "prime-rl's max_completion_tokens is rollout.max_new_tokens",
    "orchestrator.batch_size": "prime-rl's batch_size (samples per step) is rollout.quota_groups x rollout.group_size",
    "dppo_mask_low": "prime-rl's dppo_mask_low is algo.dppo_mask_low, with algo.surrogate=dppo (its default loss)",
    "dppo_mask_high": "prime-rl's dppo_mask_high is algo.dppo_mask_high, with algo.surrogate=dppo (its default loss)",
    "kl_tau": "prime-rl's kl_tau (its squared log-ratio to the inference policy) is algo.dppo_kl_coef, with "
              "algo.surrogate=dppo (its default loss), or algo.ipo_kl_coef, with algo.surrogate=ipo",
    "adv_tau": "prime-rl's adv_tau does not exist: algo.dppo_kl_coef (algo.ipo_kl_coef with its ipo loss) = kl_tau / "
               "adv_tau gives the same balance of the advantage against the squared log-ratio (prime-rl's loss is "
               "adv_tau times kv4rl's)",
    "filter_zero_advantages": "prime-rl's filter_zero_advantages (true by default there) is "
                              "trainer.mask_zero_advantage (false by default here)",
    "ipo_threshold": "prime-rl's ipo_threshold is algo.ipo_threshold, with algo.surrogate=ipo (its ipo loss)",
    "loss.type": "prime-rl's loss.type=default (DPPO with its squared log-ratio) is algo.surrogate=dppo, its ipo "
                 "algo.surrogate=ipo; a custom loss is a plug-in here (algo.plugins, algo.loss)",
    "interval": "prime-rl's eval.interval is eval.every, its ckpt.interval checkpoint.save_every",
    "scheduler.type": "AReaL's scheduler.type (where its workers run: local, ray, slurm) has no counterpart; "
                      "prime-rl's trainer.scheduler.type is trainer.lr_schedule",
    "trainer.scheduler.type": "prime-rl's scheduler.type is trainer.lr_schedule",
}

# the rest of a pasted config's everyday keys (model, inference engine, logging, checkpoint folder), per framework
EVERYDAY = {
    # prime-rl (configs under [model], [monitors], [inference], [trainer.model], [orchestrator])
    "model.name": "prime-rl's model.name (a Hugging Face id or a folder) is model.path",
    "run.name": "the run's name is the top-level name",
    "wandb.project": "the W&B project is logging.wandb_project (with logging.wandb=true)",
    "wandb.name": "the W&B run name is logging.wandb_name (with logging.wandb=true)",
    "wandb.mode": "AReaL's wandb.mode=disabled is logging.wandb=false (online: logging.wandb=true)",
    "vllm.model": "AReaL's vllm.model and prime-rl's inference.vllm.model are model.path (one model samples and trains)",
    **dict.fromkeys(("vllm.tensor_parallel_size", "vllm_tensor_parallel_size", "rollout_num_gpus_per_engine"),
                    "the rollout engine's tensor parallelism (prime-rl's and OpenRLHF's vllm tensor_parallel_size, "
                    "TRL's vllm_tensor_parallel_size, slime's rollout_num_gpus_per_engine) is engine.tensor_parallel"),
    **dict.fromkeys(("vllm.max_num_seqs", "sglang.max_running_requests"),
                    "the engine's concurrent sequences are rollout.max_slots"),
    **dict.fromkeys(("seq_len", "train_max_tokens_per_gpu", "use_dynamic_batch", "train.dynamic_batch_enable"),
                    "a packed training batch's token budget (prime-rl's seq_len, OpenRLHF's dynamic batching) is "
                    "trainer.max_tokens_per_micro_batch; the engine's context is engine.max_model_len"),
    **dict.fromkeys(("ac.freq", "recompute_granularity", "gradient_checkpointing_enable"),
                    "activation checkpointing (prime-rl's model.ac, slime's recompute_granularity, OpenRLHF's "
                    "gradient_checkpointing_enable) is trainer.grad_checkpointing=true"),
    "eval.num_examples": "prime-rl's eval.num_examples is data.eval_size",
    "eval.group_size": "prime-rl's eval.group_size (samples per evaluated problem) is eval.k",
    # AReaL's sglang section
    "sglang.context_length": "AReaL's sglang.context_length is engine.max_model_len",
    **dict.fromkeys(("sglang.mem_fraction_static", "sglang_mem_fraction_static", "vllm_gpu_memory_utilization"),
                    "the engine's share of GPU memory is engine.gpu_memory_fraction"),
    **dict.fromkeys(("sglang.model_path", "pretrain", "hf_checkpoint"),
                    "the starting model (AReaL's sglang.model_path, OpenRLHF's pretrain, slime's hf_checkpoint) is "
                    "model.path"),
    "sglang.random_seed": "the run has one seed, the top-level seed",
    "recover.mode": "AReaL's recover is kv4rl train --resume RUN_DIR (a checkpoint every checkpoint.save_every)",
    # OpenRLHF's (train.* of its dotted flags) and slime's
    **dict.fromkeys(("train.colocate_all", "colocate_all_models", "colocate"),
                    "engine and learner on the same GPUs is rollout.placement=colocated, the default"),
    "train.agent_func_path": "OpenRLHF's agent_func_path (a multi-turn agent) has no counterpart",
    **dict.fromkeys(("ckpt.path", "ckpt.output_dir", "save_path"),
                    "checkpoints and metrics go to the run folder, out_dir/name (checkpoints under its checkpoints/)"),
    **dict.fromkeys(("max_len", "data.max_len"), "OpenRLHF's max_len (prompt and response) is engine.max_model_len"),
    "apply_chat_template": "slime's and OpenRLHF's apply_chat_template is data.chat_template=true",
    **dict.fromkeys(("vllm.enable_sleep", "vllm_enable_sleep", "vllm_enable_sleep_mode"),
                    "an engine that sleeps through the update is engine.sleep_between_rollouts=true"),
    "attention_backend": "slime's attention_backend (the learner's, Megatron's) is trainer.attention; the engine's "
                         "is engine.attention_backend",
    **dict.fromkeys(("adam_beta1", "adam_beta2"), "AdamW's betas are trainer.betas, a pair: trainer.betas=[0.9,0.99]"),
    "use_wandb": "slime's use_wandb is logging.wandb",
    "rm_type": "slime's rm_type is reward.name (math_verify, exact, or a plug-in)",
    # TRL's (GRPOConfig and the TrainingArguments it extends)
    "vllm_max_model_length": "TRL's vllm_max_model_length is engine.max_model_len",
    "shuffle_dataset": "TRL's shuffle_dataset is data.shuffle",
    "max_grad_norm": "TRL's max_grad_norm is trainer.grad_clip",
    "save_total_limit": "TRL's save_total_limit is checkpoint.keep_last",
    "run_name": "TRL's run_name is the top-level name (the run folder's, and logging.wandb_name's default)",
    "report_to": "TensorBoard event files are always written; TRL's report_to=wandb is logging.wandb=true",
    "num_train_epochs": "TRL's num_train_epochs is trainer.iterations (iterations, computed by hand: "
                        "epochs x problems / rollout.quota_groups)",
}
SLIME_OPENRLHF_PRIMERL.update(EVERYDAY)

# AReaL's (inclusionAI/AReaL 4aef98d, areal/api/cli_args.py): `actor.*`, `gconfig.*`, `train_dataset.*`, ...
AREAL = {
    "ppo_n_minibatches": "AReaL's actor.ppo_n_minibatches is trainer.updates_per_batch (a count of optimizer steps)",
    "eps_clip_higher": "AReaL's actor.eps_clip_higher is algo.eps_high",
    "c_clip": "AReaL's actor.c_clip is algo.dual_clip",
    "gconfig.n_samples": "AReaL's gconfig.n_samples is rollout.group_size",
    **dict.fromkeys(("gconfig.greedy", "greedy"),
                    "AReaL's gconfig.greedy has no training counterpart; an evaluation samples greedily with "
                    "eval.temperature=0"),
    "train_dataset.batch_size": "AReaL's train_dataset.batch_size (prompts per step) is rollout.quota_groups",
    "train_dataset.path": "AReaL's train_dataset.path is data.train",
    "valid_dataset.path": "AReaL's valid_dataset.path is data.eval",
    "train_dataset.max_length": "AReaL's train_dataset.max_length is data.max_prompt_tokens (measured on the "
                                "formatted prompt here)",
    "ref.path": "AReaL's ref model (the KL reference) is the starting model here: model.path is both",
    "kl_ctl": "AReaL's actor.kl_ctl (0.1 there, with a ref model) is advantage.kl_reward_coef (0 here), a KL in the "
              "reward; AReaL subtracts it per token after the reward normalisation, kv4rl from the score before "
              "the advantages",
    "recompute_logprob": "AReaL's actor.recompute_logprob is algo.old_logprob=recompute",
    "rejection_sampling": "AReaL's rejection_sampling (metric ratio; level token / sequence, action mask / clamp, "
                          "upper, lower) is algo.behavior_is (token_mask, token_truncate, sequence_geo_mask, "
                          "sequence_geo_truncate: the ratios' geometric mean, as AReaL's), algo.behavior_is_max and "
                          "algo.behavior_is_min, with algo.old_logprob=recompute; its "
                          "metric kl_k2 with action mask is algo.behavior_rs (token_k2, seq_sum_k2, seq_mean_k2, "
                          "seq_max_k2) at its upper bound",
    **dict.fromkeys(("behave_imp_weight_cap", "behave_imp_weight_mode"),
                    "AReaL's behave_imp_weight_cap / _mode (March-April 2026) are algo.behavior_is_max and "
                    "algo.behavior_is (token_mask) with algo.old_logprob=recompute"),
    "max_head_offpolicyness": "AReaL's rollout.max_head_offpolicyness is staleness.lag (exact here; AReaL caps the "
                              "lag by throttling new requests), or with rollout.mode=partial staleness.max_versions",
    "consumer_batch_size": "AReaL's rollout.consumer_batch_size is rollout.quota_groups",
    "max_concurrent_rollouts": "AReaL's rollout.max_concurrent_rollouts is rollout.max_slots (decode slots)",
    "reward_scaling": "AReaL's reward_scaling is reward.scale",
    "reward_bias": "AReaL's reward_bias is reward.bias",
    "reward_clip": "AReaL's reward_clip (20 by default there) is reward.clip (null: no clip, by default here)",
    **dict.fromkeys(("reward_norm", "reward_norm.mean_level", "reward_norm.std_level", "reward_norm.group_size"),
                    "AReaL's reward_norm (mean_level and std_level group) is advantage.estimator=grpo (std_level "
                    "null: advantage.normalize_std=false; its eps 1e-5, 1e-6 here); no reward_norm at all is "
                    "advantage.estimator=raw (the reward itself)"),
    **dict.fromkeys(("adv_norm", "adv_norm.mean_level", "adv_norm.std_level"),
                    "AReaL's adv_norm (batch whitening of the token advantages) is advantage.whiten=true, after "
                    "advantage.estimator=grpo for its group reward_norm (or reinforce_plus_plus without one)"),
    "group_reward_norm": "AReaL's group_reward_norm (before its reward_norm) is advantage.estimator=grpo",
    "mask_no_eos_with_zero": "AReaL's mask_no_eos_with_zero has no exact counterpart: the nearest, "
                             "trainer.mask_truncated=true, trains none of a cut response's tokens where AReaL sets "
                             "its reward to 0",
    "overlong_reward_penalty": "AReaL's overlong_reward_penalty is reward.overlong_buffer > 0",
    "overlong_tokens": "AReaL's overlong_tokens is reward.overlong_buffer",
    "use_sapo_loss": "AReaL's use_sapo_loss is algo.surrogate=sapo",
    **dict.fromkeys(("beta1", "beta2"), "AReaL's optimizer.beta1 / beta2 are trainer.betas"),
    "gradient_clipping": "AReaL's optimizer.gradient_clipping is trainer.grad_clip",
    "warmup_steps_proportion": "the warm-up is trainer.warmup_iters, in iterations",
    "max_tokens_per_mb": "AReaL's mb_spec.max_tokens_per_mb is trainer.max_tokens_per_micro_batch",
    "n_mbs": "AReaL's mb_spec.n_mbs (a count of micro-batches) is trainer.micro_batch_size (rows per micro-batch)",
    "gradient_checkpointing": "AReaL's and TRL's gradient_checkpointing is trainer.grad_checkpointing",
    "total_train_epochs": "AReaL's total_train_epochs has no key here: trainer.iterations counts iterations "
                          "(epochs x rows / rollout.quota_groups)",
    "total_train_steps": "AReaL's total_train_steps is trainer.iterations",
    "saver.freq_steps": "AReaL's saver.freq_steps is checkpoint.save_every",
    "saver.freq_epochs": "AReaL's saver.freq_epochs has no key here: checkpoint.save_every counts iterations",
    "evaluator.freq_steps": "AReaL's evaluator.freq_steps is eval.every",
    "eval_before_train": "AReaL's evaluator.eval_before_train is eval.before_training",
    "trial_name": "AReaL's trial_name has no key here: the run folder is out_dir/name",
    "fileroot": "AReaL's cluster.fileroot is out_dir",
    **dict.fromkeys(("discount", "gae_lambda"),
                    "AReaL's discount / gae_lambda belong to GAE with a critic, which does not exist here "
                    "(returns are undiscounted)"),
    "m2_threshold": "AReaL's M2PO (m2_threshold) does not exist",
    **dict.fromkeys(("dynamic_bs", "dynamic_filter_fn"),
                    "AReaL's dynamic_bs with a dynamic_filter_fn is rollout.filter_groups (groups whose scores are "
                    "all equal are dropped)"),
}
