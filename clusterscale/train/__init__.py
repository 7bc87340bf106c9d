"""Training: the cluster-stratified batch schedule, the InfoNCE loss, the student model, the Ray Train loop."""
