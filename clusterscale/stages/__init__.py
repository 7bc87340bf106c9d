"""The pipeline's stages, one module (or package) each, each with one entry `run_<stage>(ctx: StageContext)`
listed in clusterscale.pipeline.STAGES: ingest, synthetic (`synth`: ingest + embed on made-up data), embed, kmeans
(fit, assign), dedup/ (policy, exact, heldout, semantic, stage), shards (shard, dedup_shards), shard_sets (the
random / random_clusters / source sets), mine (+ mine_search, mine_rows), train (the train stage on the driver: plan,
segments, Ray Train, export; its ranks run train/trainer.py), evaluate (+ eval_set, mteb_eval), report (+ report_plots,
costs)."""
