"""kubelet device plugin API v1beta1 (generated; do not edit)."""
