"""Every sentence-transformers trainer composed with `GradAccumTrainer`, in both class orders: CrossEncoder's item-mean
loss, SparseEncoder's `SpladeLoss` (in-batch negatives plus the FLOPS regularisers, batch means), a dict of losses
per dataset. One SGD step (lr 1, fp32, no clipping) at GA = K against the stock trainer on one batch of the window's
rows (sequential batch sampler: same rows, same order), relative update difference <= 1e-5; a loss that cannot be
shown exact stops before the first optimizer step with its reason (and a fix that is not refused itself); no
warning about labels where nothing needs them. CrossEncoder's ListNetLoss, which only the first-window check admits,
is compared on a model whose gradient does not cancel. Tiny random-init BERT models (tests/st_cases.py)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import datasets
import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import (  # noqa: E402
    CrossEncoderTrainer,
    CrossEncoderTrainingArguments,
    SentenceTransformerTrainer,
    losses,
)
from sentence_transformers.cross_encoder import losses as ce_losses  # noqa: E402
from sentence_transformers.multi_vector_encoder import (  # noqa: E402
    MultiVectorEncoderTrainer,
    MultiVectorEncoderTrainingArguments,
)
from sentence_transformers.multi_vector_encoder import losses as mv_losses  # noqa: E402
from sentence_transformers.sparse_encoder import (  # noqa: E402
    SparseEncoderTrainer,
    SparseEncoderTrainingArguments,
)
from sentence_transformers.sparse_encoder import losses as sparse_losses  # noqa: E402
from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import (  # noqa: E402
    SpladeRegularizerWeightSchedulerCallback,
)

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from hf_gradaccum.integrations.sentence_transformers.routing import SentenceTransformersLossError  # noqa: E402
from tests.st_cases import (  # noqa: E402
    flat,
    listwise,
    one_step,
    pairs,
    relative_difference,
    st_args,
    tiny_cross_encoder,
    tiny_multi_vector_encoder,
    tiny_sentence_transformer,
    tiny_sparse_encoder,
)
from tests.test_sentence_transformers import InBatchCentredLoss  # noqa: E402

TOL = 1e-5


def _composed(parent):
    """Both class orders of `GradAccumTrainer` with `parent`."""
    first = type(f"GradAccumFirst{parent.__name__}", (GradAccumTrainer, parent), {})
    second = type(f"{parent.__name__}First", (parent, GradAccumTrainer), {})
    return [first, second]


ORDERS = ["gradaccum_first", "parent_first"]


def _runner(folder, make_loss, data, make_model, args_cls):
    """`run(trainer_cls, batch, steps)`: one step of that trainer on a fresh model of the given kind."""

    def run(trainer_cls, batch, steps):
        return one_step(trainer_cls, folder, make_loss, batch, steps, data, make_model=make_model, args_cls=args_cls)

    return run


def _labelled_pairs(n: int) -> datasets.Dataset:
    data = pairs(n, labels=True)
    return data.map(lambda row: {"label": float(row["label"] > 0.5)})


def _unequal_tail(data: datasets.Dataset) -> datasets.Dataset:
    """The last micro-batch shorter than the others (the window's rows are not a multiple of b)."""
    return data.select(range(len(data) - 1))


# ---------------------------------------------------------------------------------------------------- CrossEncoder
@pytest.mark.parametrize("order", [0, 1], ids=ORDERS)
def test_cross_encoder_item_mean_loss_is_exact_without_refusal_or_warning(tmp_path, order, caplog):
    trainer_cls = _composed(CrossEncoderTrainer)[order]
    data = _unequal_tail(_labelled_pairs(12))  # micro-batches of 4, 4, 3
    run = _runner(tmp_path, ce_losses.BinaryCrossEntropyLoss, data, tiny_cross_encoder, CrossEncoderTrainingArguments)

    large, _ = run(CrossEncoderTrainer, 11, 1)
    stock, _ = run(CrossEncoderTrainer, 4, 3)
    with caplog.at_level(logging.WARNING):
        ours, trainer = run(trainer_cls, 4, 3)
        plain, plain_trainer = run(trainer_cls, 11, 1)
    assert trainer._st_route == "item_mean" and plain_trainer._st_route == "plain"
    assert relative_difference(ours, large) <= TOL
    assert relative_difference(plain, large) <= TOL
    # The stock trainer averages the three micro-batch means equally, whatever their sizes.
    assert relative_difference(stock, large) >= 1e-3
    assert not [r for r in caplog.records if "labels" in r.getMessage() and r.name.startswith("hf_gradaccum")]


def test_cross_encoder_in_batch_negatives_stop_before_the_first_step(tmp_path):
    """CrossEncoder's MultipleNegativesRankingLoss scores anchors against the other rows' candidates: it couples the
    batch, and it is not routed (its pairs are formed across the batch), so the first-window check refuses it."""
    trainer_cls = _composed(CrossEncoderTrainer)[0]
    model = tiny_cross_encoder(tmp_path)
    before = flat(model)
    trainer = trainer_cls(
        model=model,
        args=st_args(tmp_path, 4, 2, args_cls=CrossEncoderTrainingArguments),
        train_dataset=pairs(8),
        loss=ce_losses.MultipleNegativesRankingLoss(model, num_negatives=None),
    )
    with pytest.raises(SentenceTransformersLossError, match="MultipleNegativesRankingLoss") as error:
        trainer.train()
    assert "NOT exact" in str(error.value)
    assert torch.equal(flat(model), before)


def test_cross_encoder_cached_in_batch_negatives_refusal_gives_a_fix_that_is_not_refused_itself(tmp_path):
    """The cached CrossEncoder loss is refused like every cached loss, but its non-cached MultipleNegativesRankingLoss
    is refused too (test above), so the error must not send the user there: it says so and names what works."""
    trainer_cls = _composed(CrossEncoderTrainer)[0]
    model = tiny_cross_encoder(tmp_path)
    before = flat(model)
    trainer = trainer_cls(
        model=model,
        args=st_args(tmp_path, 4, 2, args_cls=CrossEncoderTrainingArguments),
        train_dataset=pairs(8),
        loss=ce_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
    )
    with pytest.raises(SentenceTransformersLossError, match="CachedMultipleNegativesRankingLoss") as error:
        trainer.train()
    message = str(error.value)
    assert "use MultipleNegativesRankingLoss" not in message
    assert "MultipleNegativesRankingLoss is no alternative" in message and "refused as well" in message
    assert "gradient_accumulation_steps=1" in message and "BinaryCrossEntropyLoss" in message
    assert torch.equal(flat(model), before)


def test_cross_encoder_listnet_is_checked_and_exact_where_its_gradient_does_not_cancel(tmp_path):
    """ListNetLoss (each query's cross entropy over its documents' scores, a mean over queries) has no route: the
    first-window check decides it, and the update must then be the large batch's. Micro-batches of 4, 4 and 3
    queries with 2 to 4 documents each: the stock trainer at GA = 3 weights the short one like the others, ours by
    queries as the large batch's mean does (counting documents instead, the check finds 7.0e-2 and refuses). The
    model is initialised with range 0.2, where the gradient does not cancel: at BERT's 0.02 this tiny model scores
    every pair almost alike, the gradient is 5e3 times smaller than its per-pair terms, and where fp32 applies the
    1/GA (before or after the backward) moves it by about 1e-3, so no 1e-5 comparison means much."""
    data = listwise(11)
    make_model = functools.partial(tiny_cross_encoder, initializer_range=0.2)
    run = _runner(tmp_path, ce_losses.ListNetLoss, data, make_model, CrossEncoderTrainingArguments)

    large, _ = run(CrossEncoderTrainer, 11, 1)
    stock, _ = run(CrossEncoderTrainer, 4, 3)
    assert relative_difference(stock, large) >= 1e-3
    # One class order (the routing class goes in front in both; benchmarks/st_trainers_zoo.py measures both).
    ours, trainer = run(_composed(CrossEncoderTrainer)[1], 4, 3)
    assert trainer._st_route == "checked"
    check = json.loads((Path(trainer.args.output_dir) / "accumulation_check.json").read_text())
    assert check["verdict"] == "exact" and check["max_rel_diff"] <= TOL, check
    assert relative_difference(ours, large) <= TOL


# ---------------------------------------------------------------------------------------------------- SparseEncoder
def _splade(model):
    return sparse_losses.SpladeLoss(
        model,
        loss=sparse_losses.SparseMultipleNegativesRankingLoss(model, scale=5.0),
        document_regularizer_weight=0.5,
        query_regularizer_weight=0.3,
    )


def _sparse_step(trainer_cls, folder, batch, steps, data):
    """One step with the regulariser weights at their values from the first step: the default scheduler callback
    starts them at 0, which would leave the FLOPS terms out of the comparison."""
    model = tiny_sparse_encoder(folder)
    before = flat(model)
    trainer = trainer_cls(
        model=model,
        args=st_args(folder, batch, steps, args_cls=SparseEncoderTrainingArguments),
        train_dataset=data,
        loss=_splade(model),
    )
    trainer.remove_callback(SpladeRegularizerWeightSchedulerCallback)
    trainer.train()
    return flat(model) - before, trainer


@pytest.fixture(scope="module")
def splade_references(tmp_path_factory):
    folder = tmp_path_factory.mktemp("splade")
    data = pairs(12)
    large, _ = _sparse_step(SparseEncoderTrainer, folder, 12, 1, data)
    stock, _ = _sparse_step(SparseEncoderTrainer, folder, 4, 3, data)
    return folder, data, large, stock


@pytest.mark.parametrize("order", [0, 1], ids=ORDERS)
def test_splade_loss_is_routed_to_the_coupled_mode_and_exact(splade_references, order):
    folder, data, large, stock = splade_references
    ours, trainer = _sparse_step(_composed(SparseEncoderTrainer)[order], folder, 4, 3, data)
    assert trainer._st_route == "coupled"
    assert relative_difference(ours, large) <= TOL
    assert relative_difference(stock, large) >= 1e-2


def test_splade_regularisers_see_the_whole_window(tmp_path):
    """The FLOPS regulariser alone (the ranking loss weighted 0 by an item-free base loss would hide nothing else):
    a squared batch mean, so its micro-batch version is another objective; routed, it is the large batch's."""
    data = pairs(12)

    def only_flops(model):
        loss = _splade(model)
        loss.loss.scale = 0.0  # uniform scores: the ranking loss has no gradient, the regularisers remain
        return loss

    def step(cls, batch, steps):
        model = tiny_sparse_encoder(tmp_path)
        before = flat(model)
        args = st_args(tmp_path, batch, steps, args_cls=SparseEncoderTrainingArguments)
        trainer = cls(model=model, args=args, train_dataset=data, loss=only_flops(model))
        trainer.remove_callback(SpladeRegularizerWeightSchedulerCallback)
        trainer.train()
        return flat(model) - before

    large = step(SparseEncoderTrainer, 12, 1)
    assert relative_difference(step(_composed(SparseEncoderTrainer)[0], 6, 2), large) <= TOL
    assert relative_difference(step(SparseEncoderTrainer, 6, 2), large) >= 1e-3


# ---------------------------------------------------------------------------------------------------- MultiVectorEncoder
def test_multi_vector_ranking_loss_is_routed_to_the_coupled_mode_and_exact(tmp_path):
    """Late interaction (MaxSim over token embeddings) with in-batch negatives; micro-batches of 6, 6 whose token
    axes differ in length."""
    data = pairs(12)
    run = _runner(
        tmp_path,
        lambda model: mv_losses.MultiVectorMultipleNegativesRankingLoss(model, scale=5.0),
        data,
        tiny_multi_vector_encoder,
        MultiVectorEncoderTrainingArguments,
    )

    large, _ = run(MultiVectorEncoderTrainer, 12, 1)
    stock, _ = run(MultiVectorEncoderTrainer, 6, 2)
    for trainer_cls in _composed(MultiVectorEncoderTrainer):
        ours, trainer = run(trainer_cls, 6, 2)
        assert trainer._st_route == "coupled"
        assert relative_difference(ours, large) <= TOL
    assert relative_difference(stock, large) >= 1e-2


def test_cached_multi_vector_ranking_loss_over_the_window_is_exact(tmp_path):
    """The cached late-interaction loss: at GA 2 its `calculate_loss` sees the window's token embeddings, which is the
    same loss (and the non-cached one) on one batch of 12; `mini_batch_size=4` splits neither evenly."""
    data = pairs(12)

    def cached(model):
        return mv_losses.CachedMultiVectorMultipleNegativesRankingLoss(model, scale=5.0, mini_batch_size=4)

    def runner(make):
        return _runner(tmp_path, make, data, tiny_multi_vector_encoder, MultiVectorEncoderTrainingArguments)

    large, _ = runner(cached)(MultiVectorEncoderTrainer, 12, 1)
    plain, _ = runner(lambda model: mv_losses.MultiVectorMultipleNegativesRankingLoss(model, scale=5.0))(
        MultiVectorEncoderTrainer, 12, 1
    )
    assert relative_difference(plain, large) <= TOL
    stock, _ = runner(cached)(MultiVectorEncoderTrainer, 6, 2)
    ours, trainer = runner(cached)(_composed(MultiVectorEncoderTrainer)[0], 6, 2)
    assert trainer._st_route == "coupled" and "calculate_loss" in trainer._st_reason
    assert relative_difference(ours, large) <= TOL
    assert relative_difference(stock, large) >= 1e-2


def test_cached_splade_loss_over_the_window_is_exact(tmp_path):
    """CachedSpladeLoss: the ranking loss and the FLOPS regularisers of its `calculate_loss` over the window."""
    data = pairs(12)

    def cached(model):
        return sparse_losses.CachedSpladeLoss(
            model,
            loss=sparse_losses.SparseMultipleNegativesRankingLoss(model, scale=5.0),
            document_regularizer_weight=0.5,
            query_regularizer_weight=0.3,
            mini_batch_size=5,
        )

    def step(cls, batch, steps):
        model = tiny_sparse_encoder(tmp_path)
        before = flat(model)
        args = st_args(tmp_path, batch, steps, args_cls=SparseEncoderTrainingArguments)
        trainer = cls(model=model, args=args, train_dataset=data, loss=cached(model))
        trainer.remove_callback(SpladeRegularizerWeightSchedulerCallback)
        trainer.train()
        return flat(model) - before, trainer

    large, _ = step(SparseEncoderTrainer, 12, 1)
    stock, _ = step(SparseEncoderTrainer, 4, 3)
    ours, trainer = step(_composed(SparseEncoderTrainer)[0], 4, 3)
    assert trainer._st_route == "coupled"
    assert relative_difference(ours, large) <= TOL
    assert relative_difference(stock, large) >= 1e-2


# ---------------------------------------------------------------------------------------------------- a dict of losses
def _two_datasets() -> datasets.DatasetDict:
    return datasets.DatasetDict({"ranking": pairs(4, seed=1), "scores": pairs(4, seed=2, labels=True)})


def _loss_dict(model):
    return {"ranking": losses.MultipleNegativesRankingLoss(model), "scores": losses.CoSENTLoss(model)}


def test_dict_of_losses_is_exact_per_dataset(tmp_path):
    """Micro-batches of 2 from two datasets alternate (round robin): the window holds 4 rows of each. The large
    batch per dataset is its 4 rows under its own loss; the window's update is the two, weighted by rows (each
    computed here by the stock trainer on that dataset's 4 rows alone)."""
    everything = _two_datasets()
    reference = 0
    for name in everything:
        update, _ = one_step(
            SentenceTransformerTrainer,
            tmp_path,
            _loss_dict,
            4,
            1,
            datasets.DatasetDict({name: everything[name]}),
            multi_dataset_batch_sampler="round_robin",
        )
        reference = reference + update * 0.5
    rr = {"multi_dataset_batch_sampler": "round_robin"}
    stock, _ = one_step(SentenceTransformerTrainer, tmp_path, _loss_dict, 2, 4, everything, **rr)
    for trainer_cls in _composed(SentenceTransformerTrainer):
        ours, trainer = one_step(trainer_cls, tmp_path, _loss_dict, 2, 4, everything, **rr)
        assert trainer._st_route == "coupled"
        assert relative_difference(ours, reference) <= TOL
    assert relative_difference(stock, reference) >= 1e-2


def test_dict_with_an_unknown_coupling_loss_stops_naming_it(tmp_path):
    model_losses = {}

    def make(model):
        model_losses.update(ranking=losses.MultipleNegativesRankingLoss(model), scores=InBatchCentredLoss(model))
        return model_losses

    model = tiny_sentence_transformer(tmp_path)
    before = flat(model)
    trainer = _composed(SentenceTransformerTrainer)[0](
        model=model,
        args=st_args(tmp_path, 2, 4, multi_dataset_batch_sampler="round_robin"),
        train_dataset=_two_datasets(),
        loss=make(model),
    )
    with pytest.raises(SentenceTransformersLossError, match="InBatchCentredLoss") as error:
        trainer.train()
    assert "NOT exact" in str(error.value) and "MultipleNegativesRankingLoss" not in str(error.value).splitlines()[0]
    assert torch.equal(flat(model), before)
