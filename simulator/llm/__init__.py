"""The built-in LLM-serving scenario of ``gpu-slice simulate`` (no arguments).

``cluster`` builds a mixed H100/A100/L4/L40S cluster with static MIG layouts, MPS and whole GPUs,
spot and on-demand prices; ``workload`` generates a seeded day of Deployment-like owners serving
7B-70B models; ``engine`` replays it through the shared packing state, policies and decision code.
"""
