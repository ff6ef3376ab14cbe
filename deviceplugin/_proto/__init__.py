"""Generated kubelet gRPC code; see scripts/gen_protos.py. Do not edit."""
