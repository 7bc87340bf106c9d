"""clusterscale: embed, cluster and shard pairs on Ray, then train with one cluster per global batch."""
__version__ = "0.1.0"
