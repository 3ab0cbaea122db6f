"""What every benchmark script needs and none should repeat.

``info``: where and when a result was measured; ``output``: the JSON + Markdown (+ plot) a script
writes and its ``run`` / ``report`` command line; ``server``: ``prefixserve serve`` as a subprocess
and the client processes that load it; ``models``: dummy model configs; ``timing``: GPU timing under
CUDA graphs; ``ranks``: one process per GPU in a process group, every rank's answer brought back;
``stats``: percentiles and the GPU's idle share; ``text``: prompts of a given token length. Each
module imports only the standard library, torch and prefixserve (never a script), so scripts can
share them without import circles.
"""

from benchmarks.harness.info import run_info
from benchmarks.harness.models import TINY, dummy_model
from benchmarks.harness.output import (
    RESULTS,
    ROOT,
    bar_chart,
    pyplot,
    run_or_report,
    write_results,
    write_text,
)
from benchmarks.harness.stats import gpu_idle_frac, mean, pct

__all__ = [
    "RESULTS",
    "ROOT",
    "TINY",
    "bar_chart",
    "dummy_model",
    "gpu_idle_frac",
    "mean",
    "pct",
    "pyplot",
    "run_info",
    "run_or_report",
    "write_results",
    "write_text",
]
