"""clusterscale: embed, cluster and shard pairs on Ray, then train with one cluster per global batch."""
import logging

__version__ = "0.1.0"

# faiss logs which CPU build it loads (4-8 INFO lines on every import, "Could not load library with AVX512
# support..." where a build is absent); Ray Train workers log at INFO, so every rank would print them.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
