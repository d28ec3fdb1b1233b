"""Coupled-loss mode under 2-process DDP (real gloo processes): the window is both ranks' representations, dropout
on, uneven micro-batches within and across ranks; each rank's update equals the large batch over all 18 samples.
The generic user loss runs by default; CLIP and the ranking encoder (transformers import, ~60 s on a loaded machine)
are `slow`."""

from __future__ import annotations

import json

import pytest

from tests.multiprocess import run_script

TOL = 1e-5


@pytest.mark.parametrize("cases", [("generic",), pytest.param(("clip", "ranking"), marks=pytest.mark.slow)])
def test_coupled_ddp_matches_large_batch_over_all_ranks(tmp_path, cases):
    out = tmp_path / "coupled_ddp.json"
    run_script("tests/workers/coupled_ddp.py", str(out), *cases, timeout=600)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank, results in enumerate(ranks):
        assert sorted(results) == sorted(cases)
        for case, r in results.items():
            print(f"rank {rank} {case}: coupled {r['coupled']:.2e}, plain accumulation {r['plain']:.2e}")
            assert r["items"] == 18  # both ranks' samples form the window
            assert r["coupled"] <= TOL, (rank, case, r)
            assert r["plain"] > 1e-2, (rank, case, r)
            if case in ("generic", "clip"):
                assert r["loss_params"] == 1  # the learnable temperature
