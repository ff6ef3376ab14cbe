"""``gpu-slice fake-cluster``: write a v1 List of fake GPU nodes (and running slice pods) to a file.

The generation is in ``gpuslice.fakecluster`` (pure, seeded); this module parses flags, writes the
file and turns invalid arguments into one line on stderr and exit code 2, like argparse does.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from gpuslice.annotations import parse_time
from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import GpuSliceError
from gpuslice.fakecluster import CLUSTER_MODES, FakeClusterSpec, generate
from gpuslice.kubelist import dump_list

EXIT_USAGE = 2
DEFAULT_TIME = "2025-01-01T00:00:00Z"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand (the dispatcher in ``gpuslice_cli.main`` builds the parser)."""
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes (>= 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default 8)")
    parser.add_argument("--product", default="H100-80GB", metavar="P",
                        help=f"catalogue product (default H100-80GB); one of {', '.join(PRODUCTS)}")
    parser.add_argument("--mode", default="mps", choices=CLUSTER_MODES,
                        help="GPU mode; mixed draws mig (random legal layouts), mps and whole per GPU")
    parser.add_argument("--slices", type=int, default=7, metavar="S",
                        help="slices per mps/whole GPU, 1..48 (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same file (default 0)")
    parser.add_argument("--pods-per-node", type=int, default=0, metavar="K",
                        help="Running slice pods per node, each on a valid placement (default 0)")
    parser.add_argument("--time", default=DEFAULT_TIME, metavar="RFC3339",
                        help=f"the cluster's 'now' for timestamps (default {DEFAULT_TIME}, for reproducible files)")
    parser.add_argument("--node-prefix", default="gpu-node", help="node name prefix (default gpu-node)")
    parser.add_argument("-o", "--output", default="-", metavar="FILE",
                        help="where to write the YAML List ('-' for stdout, the default)")


def _fail(message: str) -> int:
    print(f"gpu-slice fake-cluster: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    """Generate and write; 0 on success, 2 on invalid arguments, 1 when the file cannot be written."""
    try:
        now: datetime = parse_time(args.time, what="--time")
        spec = FakeClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, product=args.product,
                               mode=args.mode, slices=args.slices, seed=args.seed,
                               pods_per_node=args.pods_per_node, now=now, node_prefix=args.node_prefix)
        cluster = generate(spec)
    except GpuSliceError as err:
        return _fail(str(err))
    text = dump_list(cluster.document)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as err:
            print(f"gpu-slice fake-cluster: error: cannot write {args.output}: {err.strerror}", file=sys.stderr)
            return 1
    if cluster.unplaced:
        print(f"gpu-slice fake-cluster: note: {cluster.unplaced} of {spec.nodes * spec.pods_per_node} pods "
              "did not fit and were left out", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run without the ``gpu-slice`` dispatcher (``python -m gpuslice_cli.fake_cluster``)."""
    parser = argparse.ArgumentParser(prog="gpu-slice fake-cluster",
                                     description="write a v1 List of fake GPU nodes and pods")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
