"""Generated from protos/podresources; do not edit."""
