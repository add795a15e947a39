"""Fidelity study of anchorkv's codecs (plain torch, CPU): `python -m benchmarks.fidelity`.

Modules: `data` (input models), `layers` (KDA and Gated DeltaNet layers around fla-core's
reference recurrences, `fla_ref`), `mla` (absorbed-query MLA attention), `metrics` (SQNR,
errors), `study` (the conditions and the runs), `presets` (the rule that names the presets),
`report` (the markdown).
"""

from anchorkv.testing.metrics import sqnr_db

from .metrics import max_rel_err, rel_err_per_step
from .presets import LEVELS, MAX_THRESHOLD, RULE, THRESHOLD, choose, choose_presets
from .study import CODECS, DECAYS, LOGIT_STDS, StudyConfig, run_study

__all__ = [
    "CODECS", "DECAYS", "LEVELS", "LOGIT_STDS", "MAX_THRESHOLD", "RULE", "THRESHOLD", "StudyConfig",
    "choose", "choose_presets", "max_rel_err", "rel_err_per_step", "run_study", "sqnr_db",
]
