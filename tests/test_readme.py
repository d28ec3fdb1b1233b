"""Every ```python block of README.md runs, imports included, on tiny offline models.

A block may be preceded by an HTML comment that the README reader does not see:

- `<!-- readme-test: given a, b -->`: the block uses names the user already has (their model, data, optimizer);
  `GIVEN` below builds tiny offline ones under those names, and the block's own code (imports included) runs as is.
- `<!-- readme-test: skip: why -->`: the block is a sketch that cannot run on its own; the reason is shown as the
  skip reason. Any other block runs with nothing given.

The plain-loop quickstart is also checked for what it promises: on a causal LM whose micro-batches hold different
token counts, the README's loop makes exactly the hand-computed large-batch step (1e-5 relative, fp32).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from tests.composition_cases import text_dataset, tiny_gpt2, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!--\s*readme-test:(?P<marker>.*?)-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def readme_blocks() -> list[tuple[int, str, str]]:
    """(line number, marker text, code) of every ```python block of README.md."""
    text = (ROOT / "README.md").read_text()
    return [
        (text.count("\n", 0, m.start("code")), " ".join((m.group("marker") or "").split()), m.group("code"))
        for m in FENCE.finditer(text)
    ]


def causal_lm_batches(n_batches: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of a tiny GPT-2 with very different token counts (padding labelled -100)."""
    tokenizer = word_tokenizer()
    texts = text_dataset(n_batches * rows)["text"]
    batches = []
    for k in range(n_batches):
        enc = tokenizer(texts[k * rows : (k + 1) * rows], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels})
    return batches


def _trainer_inputs() -> dict:
    import datasets

    tokenizer = word_tokenizer()

    def encode(batch):
        enc = tokenizer(batch["text"], padding="max_length", max_length=16, truncation=True)
        enc["labels"] = [
            [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
        ]
        return enc

    def data(n: int, seed: int) -> datasets.Dataset:
        return text_dataset(n, seed=seed).map(encode, batched=True, remove_columns=["text"])

    torch.manual_seed(0)
    return {"model": tiny_gpt2(), "train": data(64, 1), "test": data(16, 2)}


def _loop_inputs() -> dict:
    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return {
        "model": model,
        "loader": causal_lm_batches(n_batches=8, rows=3),
        "optimizer": optimizer,
        "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    }


# name set a block is given -> a builder of those names (tiny, offline, fast)
GIVEN = {
    frozenset({"model", "train", "test"}): _trainer_inputs,
    frozenset({"model", "loader", "optimizer", "lr_scheduler"}): _loop_inputs,
}


def _given(marker: str) -> dict:
    names = frozenset(n.strip() for n in marker.removeprefix("given").split(",") if n.strip())
    assert names in GIVEN, f"no tiny inputs for a README block given {sorted(names)}; add them to GIVEN"
    return GIVEN[names]()


BLOCKS = readme_blocks()


def test_the_readme_has_python_blocks_and_every_skip_says_why():
    assert len(BLOCKS) >= 3
    for line, marker, _ in BLOCKS:
        if marker.startswith("skip"):
            assert len(marker.removeprefix("skip").strip(" :")) > 20, f"README line {line}: a skip needs a reason"


@pytest.mark.parametrize(("line", "marker", "code"), BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line, marker, code, tmp_path, monkeypatch):
    if marker.startswith("skip"):
        pytest.skip(marker.removeprefix("skip").strip(" :"))
    monkeypatch.chdir(tmp_path)  # blocks may write (the Trainer's "out" folder)
    namespace = _given(marker) if marker.startswith("given") else {}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 (the README's own code)
    if "trainer" in namespace:
        # 64 rows, 8 x 8 per optimizer step, 2 epochs.
        assert namespace["trainer"].state.global_step == 2


def test_readme_plain_loop_makes_the_large_batch_step_on_a_causal_lm(monkeypatch, tmp_path):
    """The quickstart loop, as written, on GPT-2 micro-batches of unequal token counts: one window of 8 micro-batches
    must equal one SGD step on the mean loss over all the window's shifted labels (clipped at norm 1.0, as in the
    block). Counting unshifted labels would miss this by ~1e-2."""
    (line, _, code) = next(b for b in BLOCKS if "GradientAccumulator(" in b[2] and "accumulator.backward(" in b[2])
    monkeypatch.chdir(tmp_path)
    namespace = _loop_inputs()
    reference = copy.deepcopy(namespace["model"])
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102

    # Hand-computed large batch: token-level cross-entropy summed over the window, divided by its shifted labels.
    reference.zero_grad()
    total, count = 0.0, 0
    for batch in namespace["loader"]:
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shifted = batch["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100, reduction="sum"
        )
        count += int((shifted != -100).sum())
    (total / count).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad

    got = torch.cat([p.detach().flatten() for p in namespace["model"].parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    start = torch.cat([p.detach().flatten() for p in _loop_inputs()["model"].parameters()])
    assert (want - start).norm() > 1e-3  # the step moved the weights: the comparison means something
    rel = float((got - want).norm() / (want - start).norm())
    assert rel <= 1e-5, f"README loop vs the large-batch step: relative difference {rel:.2e}"
