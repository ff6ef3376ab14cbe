"""kubelet PodResources API v1 (generated; do not edit)."""
