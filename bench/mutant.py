"""One mutant of bench/mutation_sweep.py and the test selections the mutant lists name
(bench/mutants.py gathers them; bench/mutants_cohort.py holds the cohort engine's)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    module: str
    name: str
    file: str
    find: str
    replace: str
    what: str
    tests: tuple[str, ...]
    equivalent: str = ""  # why the edit changes nothing a user can see (measured), if it does not


PRIVACY = ("tests/test_privacy.py", "tests/test_secagg.py")
FLEET = ("tests/test_fleet.py",)
TRACKING = ("tests/test_tracking.py",)
EXPORT = ("tests/test_export.py",)
GGUF = ("tests/test_device_export.py", "-k", "gguf or q_and_k or qwen2")
COHORT = ("tests/test_cohort.py",)
AMOLE_COHORT = ("tests/test_cohort_fedamole.py",)
FDLORA = ("tests/test_baselines.py", "-k", "fdlora")
EXECUTORCH = ("tests/test_executorch_training.py", "-k", "run_whose or mixture_round or mixture_step")
QUANT = ("tests/test_quant.py", "tests/test_quant_q4.py", "tests/test_fleet.py", "-k", "quant or q4 or int8 or nf4")


def _m(module, name, file, find, replace, what, tests, equivalent=""):
    return Mutant(module, name, file, find, replace, what, tuple(tests), equivalent)
