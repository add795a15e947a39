"""Fidelity study of anchorkv's codecs (plain torch, CPU): `python -m benchmarks.fidelity`.

Modules: `data` (realistic generators), `kda` (reference gated delta rule and KDA layer),
`mla` (absorbed-query MLA attention), `metrics` (SQNR, errors), `study` (the study and the rule
that picks the default codec per field kind).
"""

from .metrics import max_rel_err, rel_err_per_step, sqnr_db
from .study import CODECS, MAX_THRESHOLD, RULE, THRESHOLD, StudyConfig, choose_default, run_study

__all__ = [
    "CODECS", "MAX_THRESHOLD", "RULE", "THRESHOLD", "StudyConfig", "choose_default", "max_rel_err",
    "rel_err_per_step", "run_study", "sqnr_db",
]
