"""Training: loop (the train stage on the driver: plan, segments, Ray Train, export; run_train), recluster
(segment arithmetic), trainer (each rank: setup, train_step, fit), schedule (the cluster-stratified batch
schedule), data (reading a shard set's row groups), step, loss and gradcache (InfoNCE / CLP, chunked re-forward),
negatives (mined negatives and their sidecars), optim (AdamW, LR schedule), checkpoint, metrics."""
