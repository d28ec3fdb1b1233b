"""The TRL zoo as a test: every trainer TRL 1.16 ships (stable and `trl.experimental`) that can be built offline,
composed with `GradAccumTrainer` in both class orders at GA = 3, is exact against the same trainer, stock, at GA = 1 on
the whole window (relative update difference <= 1e-5, fp32, tiny random-init models, the same samples and, for
generating trainers, the same generations), or refused with a `CompositionError` before its first optimizer step.
None trains silently wrong, none crashes. See `tests/trl_zoo_cases.py` for the cases and the generation stand-in.

The default run keeps the trainers that trained silently wrong, crashed or were refused before counting moved to the
loss (GKD on-policy, GMPO, Distillation, GOLD, IW-OPD, A*-PO, SDFT, SDPO, Online DPO), one loss of each kind weighted
per term (DPO's RPO, TPO with `tpo_alpha`, GRPO's entropy bonus) and a sort over the window (`aot_unpaired`); the full
zoo is `slow` (`pytest tests/test_trl_zoo.py -m slow`; the table: `python benchmarks/trl_zoo.py`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.trl_zoo_cases import CASES, run_case, stock_reference  # noqa: E402

ORDERS = ("gradaccum_first", "trl_first")


def _id(case) -> str:
    return f"{case.name}[{case.variant}]"


def _check(case, tmp_path) -> None:
    reference = stock_reference(case, str(tmp_path / "stock"))
    for order in ORDERS:
        result = run_case(case, order, reference, str(tmp_path / order))
        assert result.verdict == case.expect, (
            f"{_id(case)}, {order}: expected {case.expect}, got {result.verdict} "
            f"(relative update difference {result.error}; {result.message})"
        )
        if result.verdict == "refused":
            assert case.name in result.message or "GradAccumTrainer" in result.message, result.message


@pytest.mark.parametrize("case", [c for c in CASES if c.fast], ids=_id)
def test_trl_trainer_is_exact_or_refused(case, tmp_path):
    _check(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.fast], ids=_id)
def test_trl_zoo_rest_is_exact_or_refused(case, tmp_path):
    _check(case, tmp_path)
