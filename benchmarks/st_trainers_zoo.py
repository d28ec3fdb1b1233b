#!/usr/bin/env python
"""Every sentence-transformers trainer composed with `GradAccumTrainer`, one loss per row: the update of one SGD step
(lr 1, fp32, no clipping) at b x GA against the stock trainer's update on one batch of the same rows in the same
order (sequential batch sampler), for the stock trainer at GA and for ours in both class orders; or the first line of
the refusal. Tiny random-init 2-layer BERT models, dropout off, offline (`tests/st_cases.py`).

    python benchmarks/st_trainers_zoo.py            # run from the repository root; prints a Markdown table
    python benchmarks/st_trainers_zoo.py ListNet    # only the rows whose loss name contains "ListNet"

Rows: what `integrations/sentence_transformers/routing.py` routes (coupled, item mean) and what it checks and refuses.
"""

from __future__ import annotations

import functools
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import transformers  # noqa: E402
from sentence_transformers import (  # noqa: E402
    CrossEncoderTrainer,
    CrossEncoderTrainingArguments,
    SentenceTransformerTrainer,
    losses,
)
from sentence_transformers.cross_encoder import losses as ce  # noqa: E402
from sentence_transformers.multi_vector_encoder import (  # noqa: E402
    MultiVectorEncoderTrainer,
    MultiVectorEncoderTrainingArguments,
)
from sentence_transformers.multi_vector_encoder import losses as mv  # noqa: E402
from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments  # noqa: E402
from sentence_transformers.sparse_encoder import losses as sparse  # noqa: E402
from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import (  # noqa: E402
    SpladeRegularizerWeightSchedulerCallback,
)

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from tests.st_cases import (  # noqa: E402
    flat,
    listwise,
    pairs,
    relative_difference,
    st_args,
    tiny_cross_encoder,
    tiny_multi_vector_encoder,
    tiny_sentence_transformer,
    tiny_sparse_encoder,
)

B, K = 4, 3
INIT_02 = functools.partial(tiny_cross_encoder, initializer_range=0.2)


def _binary(n: int = 12) -> datasets.Dataset:
    return pairs(n, labels=True).map(lambda row: {"label": float(row["label"] > 0.5)})


def _splade(model):
    return sparse.SpladeLoss(
        model,
        loss=sparse.SparseMultipleNegativesRankingLoss(model, scale=5.0),
        document_regularizer_weight=0.5,
        query_regularizer_weight=0.3,
    )


# (trainer, arguments, model, loss name, loss factory, dataset)
CASES = [
    (SentenceTransformerTrainer, None, tiny_sentence_transformer, "MultipleNegativesRankingLoss",
     losses.MultipleNegativesRankingLoss, pairs(12)),
    (SentenceTransformerTrainer, None, tiny_sentence_transformer, "CoSENTLoss", losses.CoSENTLoss,
     pairs(12, labels=True)),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, tiny_cross_encoder, "BinaryCrossEntropyLoss (11 rows: 4+4+3)",
     ce.BinaryCrossEntropyLoss, _binary().select(range(11))),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, tiny_cross_encoder, "MultipleNegativesRankingLoss (all negatives)",
     lambda m: ce.MultipleNegativesRankingLoss(m, num_negatives=None), pairs(12)),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, tiny_cross_encoder, "ListNetLoss", ce.ListNetLoss, listwise()),
    # At BERT's initializer range (0.02) this tiny model scores every pair almost alike and the listwise gradient
    # cancels to fp32 rounding; at 0.2 it does not.
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, INIT_02, "ListNetLoss (initializer range 0.2)", ce.ListNetLoss,
     listwise()),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, tiny_cross_encoder, "ListMLELoss", ce.ListMLELoss, listwise()),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, INIT_02, "ListMLELoss (initializer range 0.2)", ce.ListMLELoss,
     listwise()),
    (CrossEncoderTrainer, CrossEncoderTrainingArguments, tiny_cross_encoder, "LambdaLoss", ce.LambdaLoss, listwise()),
    (SparseEncoderTrainer, SparseEncoderTrainingArguments, tiny_sparse_encoder,
     "SpladeLoss(SparseMultipleNegativesRankingLoss)", _splade, pairs(12)),
    (MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments, tiny_multi_vector_encoder,
     "MultiVectorMultipleNegativesRankingLoss", lambda m: mv.MultiVectorMultipleNegativesRankingLoss(m, scale=5.0),
     pairs(12)),
]  # fmt: skip


def step(trainer_cls, args_cls, make_model, make_loss, data, folder, batch, steps):
    model = make_model(folder)
    before = flat(model)
    args = st_args(folder, batch, steps, args_cls=args_cls)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, loss=make_loss(model))
    # SpladeLoss's default scheduler starts the regulariser weights at 0 on the first step: compare with them on.
    trainer.remove_callback(SpladeRegularizerWeightSchedulerCallback)
    trainer.train()
    return flat(model) - before, trainer


def main() -> None:
    transformers.logging.set_verbosity_error()
    print("| trainer | loss | stock GA=3 vs one batch | (GradAccumTrainer, trainer) | (trainer, GradAccumTrainer) |")
    print("|---|---|---:|---|---|")
    wanted = sys.argv[1:]
    for trainer_cls, args_cls, make_model, name, make_loss, data in CASES:
        if wanted and not any(word in name for word in wanted):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            rows = len(data)
            large, _ = step(trainer_cls, args_cls, make_model, make_loss, data, folder, rows, 1)
            stock, _ = step(trainer_cls, args_cls, make_model, make_loss, data, folder, B, K)
            cells = []
            for composed in ((GradAccumTrainer, trainer_cls), (trainer_cls, GradAccumTrainer)):
                cls = type(f"{composed[0].__name__}_{composed[1].__name__}", composed, {})
                try:
                    ours, trainer = step(cls, args_cls, make_model, make_loss, data, folder, B, K)
                    cells.append(f"{relative_difference(ours, large):.1e} ({trainer._st_route})")
                except Exception as error:  # the refusal is the result: its check summary, else its first line
                    lines = str(error).splitlines()
                    found = [line.split(";")[0] for line in lines if line.startswith("split invariance")]
                    cells.append(f"refused ({type(error).__name__}): {(found or lines)[0][:110]}")
            print(
                f"| {trainer_cls.__name__} | {name} | {relative_difference(stock, large):.1e} | {' | '.join(cells)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
