"""``python -m gpuslice_cli`` runs the ``gpu-slice`` command."""

from gpuslice_cli.main import main

raise SystemExit(main())
