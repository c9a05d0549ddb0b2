"""ranktrace: profiling and straggler diagnosis for distributed training.

Everything installs under this one import name, so a training job with its own `trainer.py`,
`app/` or `analysis/` never shadows ranktrace (nor ranktrace its modules). The project's folders
keep their places in the source tree and are mapped into this package by pyproject.toml:

    ranktrace.trainer    the reference 3D-parallel trainer       (trainer/)
    ranktrace.telemetry  per-rank recording into Parquet segments (telemetry/)
    ranktrace.analysis   the store, its SQL views and analyzers   (analysis/)
    ranktrace.app        the CLI and the dashboard                 (app/)
    ranktrace.importers  per-op and torch profiler traces          (importers/)
    ranktrace.tools      test tools (network namespaces)           (tools/)
"""

__version__ = "0.1.0"
