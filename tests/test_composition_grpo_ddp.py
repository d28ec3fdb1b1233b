"""A composed GRPOTrainer under real DDP (2 gloo processes, one window of 3 micro-batches of 4 completions per rank):
the update equals one SGD(lr=1) step on both ranks' completions as one batch (token mean over all of their completion
tokens), for `dapo` and `bnpo`, one class order each. Tolerance 1e-5 relative, fp32. The worker is
`tests/workers/grpo_ddp.py`."""

import re

import pytest

from tests.multiprocess import launch

pytest.importorskip("trl")


@pytest.mark.parametrize(
    ("loss_type", "order", "entropy_coef", "quantile"),
    [
        # The first two are covered, path for path, by the last two (same loss and order, more terms): slow.
        pytest.param("dapo", "gradaccum_first", "0", "1", marks=pytest.mark.slow),
        pytest.param("bnpo", "grpo_first", "0", "1", marks=pytest.mark.slow),
        ("grpo", "grpo_first", "0.1", "1"),
        ("dapo", "gradaccum_first", "0.1", "0.5"),
    ],
)
def test_composed_grpo_under_ddp_equals_one_batch_over_both_ranks(tmp_path, loss_type, order, entropy_coef, quantile):
    # `grpo` with an entropy bonus: two terms, each weighted by its own count summed over both ranks; with an entropy
    # quantile, the threshold is the window's over both ranks and the bonus a mean over the tokens it keeps.
    proc = launch(str(tmp_path), loss_type, order, entropy_coef, quantile, script="tests/workers/grpo_ddp.py")
    match = re.search(r"relative update error (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(match.group(1)) <= 1e-5, proc.stdout[-2000:]
