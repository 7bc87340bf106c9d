"""Training's components (the train stage that drives them is stages/train.py): recluster (segment arithmetic),
trainer (each rank: setup, train_step, fit), samplers (the registered batch samplers: which shard sets a batch is
drawn from and how; clustered, random, random_clusters, source, curriculum), schedule (the stratified batch schedule
they share), data (reading a shard set's row groups), step (one contrastive gradient step), losses (the registered
train.loss choices: infonce, clp), loss and gradcache (their math, chunked re-forward), negatives (mined negatives
and their sidecars), optim (AdamW, LR schedule), checkpoint, metrics.

Each component's config sits beside it in a torch-free module (the config layer composes them into
TrainConfig): schedule_config, optim_config, loss_config, data_config (re-clustering, dedup), trainer_config
(workers, devices), metrics_config (logging), checkpoint_config."""
