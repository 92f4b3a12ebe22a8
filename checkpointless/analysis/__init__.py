"""Analysis tools outside the runtime path (the cluster-scale goodput simulator)."""
