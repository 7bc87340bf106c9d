"""The pipeline's stages, one module each: ingest, embed, kmeans (fit, assign), shards, mine, evaluate (+ mteb_eval), report (+ report_plots, costs), synthetic."""
