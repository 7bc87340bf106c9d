"""`clusterscale plan`: what N pairs at k clusters will cost per stage on a cluster, before it runs.

build (the entry: make_plan) -> cluster (the cluster's nodes, GPUs, CPUs, disk), shape (cluster sizes, training
steps, files: the train schedule's and the stages' own rules), rates (measured rates: calibration file, a run's
costs.json, a GPU calibration; datasheet fallback), estimate (per stage); render (text, --json, report's table);
calibrate (`plan --calibrate`: times the stages on synth runs here)."""
