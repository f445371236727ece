"""Reading result files for the analysis notebooks: discovery, loading, joins and statistics.

The notebooks in ``analysis/`` call these functions and draw; every number they
show is computed here from Parquet/JSON written by ``jobs/evaluate.py``,
``jobs/bench_decode.py`` and the Serve application and its load generator.
"""

from speed.analysis.flips import flip_rates, flip_rates_by_position
from speed.analysis.results import Evaluation, Results, discover, load_evaluation
from speed.analysis.serving import load_summary, rows_per_step
from speed.analysis.tradeoff import tradeoff

__all__ = [
    "Evaluation",
    "Results",
    "discover",
    "flip_rates",
    "flip_rates_by_position",
    "load_evaluation",
    "load_summary",
    "rows_per_step",
    "tradeoff",
]
