"""`GradAccumTrainer` composed with sentence-transformers' `SentenceTransformerTrainer`, in both class orders: one SGD
step (lr 1, fp32, no clipping) at GA = K = 3, b = 4 equals the stock trainer's step on one batch of b x K = 12 of the
same rows in the same order (sequential batch sampler), relative update difference <= 1e-5, for the in-batch losses
(MultipleNegativesRankingLoss, the symmetric variant, GISTEmbedLoss) and a score loss that compares all pairs
(CoSENT); the stock trainer at GA = K is far from it (>= 1e-2). Cached losses are refused, and a loss that couples
the batch but is not known stops before the first optimizer step. Real sentence-transformers and tiny random-init
BERT models (tests/st_cases.py)."""

from __future__ import annotations

import warnings

import datasets
import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformerTrainer, losses  # noqa: E402
from sentence_transformers.util import dot_score  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from hf_gradaccum.integrations.sentence_transformers.routing import (  # noqa: E402
    SentenceTransformersLossError,
    register_sentence_transformers_loss,
    sentence_transformers_route,
)
from tests.st_cases import B, K, flat, one_step, pairs, relative_difference, tiny_sentence_transformer  # noqa: E402

TOL = 1e-5


class GradAccumFirst(GradAccumTrainer, SentenceTransformerTrainer):
    pass


class SentenceTransformerFirst(SentenceTransformerTrainer, GradAccumTrainer):
    pass


def _symmetric(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return losses.MultipleNegativesSymmetricRankingLoss(model, scale=10.0)


def _gist(model, tmp_path):
    guide = tiny_sentence_transformer(tmp_path, seed=7)
    return losses.GISTEmbedLoss(model, guide, temperature=0.05, margin=-0.05)


LOSSES = {
    "mnrl": lambda model, tmp: losses.MultipleNegativesRankingLoss(model),
    "mnrl_dot_gte": lambda model, tmp: losses.MultipleNegativesRankingLoss(
        model,
        scale=1.0,
        similarity_fct=dot_score,
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
    ),
    "symmetric": lambda model, tmp: _symmetric(model),
    "gist": _gist,
    "cosent": lambda model, tmp: losses.CoSENTLoss(model),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Stock trainer, per loss: the update of one batch of b x K, and the update at GA = K."""
    cache = {}

    def get(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            data = pairs(B * K, labels=name == "cosent")
            large, _ = one_step(SentenceTransformerTrainer, tmp, lambda m: LOSSES[name](m, tmp), B * K, 1, data)
            stock, _ = one_step(SentenceTransformerTrainer, tmp, lambda m: LOSSES[name](m, tmp), B, K, data)
            cache[name] = (large, stock, tmp, data)
        return cache[name]

    return get


@pytest.mark.parametrize(
    "trainer_cls", [GradAccumFirst, SentenceTransformerFirst], ids=["gradaccum_first", "st_first"]
)
@pytest.mark.parametrize("name", ["mnrl", "symmetric", "gist", "cosent", "mnrl_dot_gte"])
def test_composed_trainer_equals_the_large_batch(references, name, trainer_cls):
    large, stock, tmp, data = references(name)
    ours, trainer = one_step(trainer_cls, tmp, lambda m: LOSSES[name](m, tmp), B, K, data)
    assert trainer._st_route == "coupled"
    assert relative_difference(ours, large) <= TOL
    # The stock trainer at GA = K trains another objective (each micro-batch's own negatives/pairs).
    assert relative_difference(stock, large) >= 1e-2


def test_nothing_is_routed_at_one_accumulation_step(tmp_path):
    data = pairs(B * K)
    mnrl = LOSSES["mnrl"]
    large, _ = one_step(SentenceTransformerTrainer, tmp_path, lambda m: mnrl(m, tmp_path), B * K, 1, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path, lambda m: mnrl(m, tmp_path), B * K, 1, data)
    assert trainer._st_route == "plain"
    assert relative_difference(ours, large) <= TOL


def test_cached_guided_loss_is_refused_before_any_step(tmp_path):
    model = tiny_sentence_transformer(tmp_path)
    before = flat(model)
    from tests.st_cases import st_args

    guide = tiny_sentence_transformer(tmp_path, seed=7)
    trainer = GradAccumFirst(
        model=model,
        args=st_args(tmp_path, B, K),
        train_dataset=pairs(B * K),
        loss=losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=2),
    )
    with pytest.raises(SentenceTransformersLossError, match="CachedGISTEmbedLoss") as error:
        trainer.train()
    assert "GradAccumFirst" in str(error.value) and "use GISTEmbedLoss" in str(error.value)
    assert torch.equal(flat(model), before)


@pytest.mark.parametrize("large_loss", ["cached", "mnrl"])
def test_cached_loss_over_the_window_equals_the_large_batch(tmp_path, large_loss):
    """The coupled mode is gradient caching over the window: CachedMultipleNegativesRankingLoss at GA = K equals the
    same loss on one batch of b x K (its own gradient cache, within that batch), which is MultipleNegativesRankingLoss
    on that batch; its `mini_batch_size` (3, which splits neither the micro-batches nor the window evenly) only bounds
    memory. The stock trainer at GA = K caches within each micro-batch and trains another objective."""
    data = pairs(B * K)

    def cached(model):
        return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)

    large_make = cached if large_loss == "cached" else losses.MultipleNegativesRankingLoss
    large, _ = one_step(SentenceTransformerTrainer, tmp_path, large_make, B * K, 1, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path, cached, B, K, data)
    assert trainer._st_route == "coupled" and "calculate_loss" in trainer._st_reason
    assert relative_difference(ours, large) <= TOL
    stock, _ = one_step(SentenceTransformerTrainer, tmp_path, cached, B, K, data)
    assert relative_difference(stock, large) >= 1e-2


class InBatchCentredLoss(torch.nn.Module):
    """A loss the router does not know that couples the batch: each embedding is centred on the batch mean."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, features, labels):
        anchors, positives = (self.model(f)["sentence_embedding"] for f in features)
        centred = anchors - anchors.mean(0, keepdim=True)
        return (centred - positives).pow(2).sum(-1).mean()


class RowLoss(InBatchCentredLoss):
    """A loss the router does not know that is a mean over independent rows."""

    def forward(self, features, labels):
        anchors, positives = (self.model(f)["sentence_embedding"] for f in features)
        return (anchors - positives).pow(2).sum(-1).mean()


@pytest.mark.parametrize(
    "trainer_cls", [GradAccumFirst, SentenceTransformerFirst], ids=["gradaccum_first", "st_first"]
)
def test_unknown_coupling_loss_stops_before_the_first_step(tmp_path, trainer_cls):
    model = tiny_sentence_transformer(tmp_path)
    before = flat(model)
    from tests.st_cases import st_args

    trainer = trainer_cls(
        model=model, args=st_args(tmp_path, B, K), train_dataset=pairs(B * K), loss=InBatchCentredLoss(model)
    )
    with pytest.raises(SentenceTransformersLossError) as error:
        trainer.train()
    message = str(error.value)
    assert trainer_cls.__name__ in message and "InBatchCentredLoss" in message
    assert "NOT exact" in message and "register_sentence_transformers_loss" in message
    assert torch.equal(flat(model), before)


def test_unknown_row_loss_passes_the_check_and_is_exact(tmp_path):
    data = pairs(B * K)
    large, _ = one_step(SentenceTransformerTrainer, tmp_path, RowLoss, B * K, 1, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path, RowLoss, B, K, data)
    assert trainer._st_route == "checked"
    assert relative_difference(ours, large) <= TOL


def test_registered_loss_takes_its_route():
    class Declared(RowLoss):
        pass

    register_sentence_transformers_loss(Declared, "item_mean")
    assert sentence_transformers_route(Declared(None))[0] == "item_mean"
    assert sentence_transformers_route(InBatchCentredLoss(None))[0] == "checked"
    with pytest.raises(ValueError, match="compute_loss_from_embeddings"):
        register_sentence_transformers_loss(Declared, "coupled")


def test_registration_does_not_cover_a_subclass_that_redefines_the_loss():
    """A subclass that keeps the registered loss's methods inherits its route; one that overrides `forward` (a loss
    of its own: the coupled route would replay the parent's `compute_loss_from_embeddings` and skip it) does not."""

    class Declared(RowLoss):
        pass

    class Renamed(Declared):
        pass

    class OwnForward(Declared):
        def forward(self, features, labels=None):
            return 2 * super().forward(features, labels)

    register_sentence_transformers_loss(Declared, "item_mean")
    assert sentence_transformers_route(Renamed(None))[0] == "item_mean"
    assert sentence_transformers_route(OwnForward(None))[0] == "checked"
    register_sentence_transformers_loss(OwnForward, "item_mean")
    assert sentence_transformers_route(OwnForward(None))[0] == "item_mean"


def _columns(n: int, columns: tuple[str, ...], label: str | None) -> datasets.Dataset:
    """`n` rows with the text columns of `pairs` (a third column is the positive of the next row) and a label:
    `score` (a float in [0, 1]), `binary` (0 or 1), `two` (two teacher scores). The texts of a row all differ (the
    positive gets one more word): a Euclidean distance of zero has no gradient in older sentence-transformers
    releases (`sqrt` at 0), which would make the large batch's own update NaN."""
    base = pairs(n, labels=True)
    texts = {
        "anchor": base["anchor"],
        "positive": [f"{p} {a.split()[0]}" for a, p in zip(base["anchor"], base["positive"], strict=True)],
    }
    texts["negative"] = texts["positive"][1:] + texts["positive"][:1]
    rows = {name: texts[name] for name in columns}
    for row in zip(*(rows[name] for name in columns), strict=True):
        assert len(set(row)) == len(row), row
    scores = base["label"]
    if label == "score":
        rows["label"] = scores
    elif label == "binary":
        rows["label"] = [float(s > 0.5) for s in scores]
    elif label == "two":
        rows["label"] = [[4 * s, 4 * (1 - s)] for s in scores]
    return datasets.Dataset.from_dict(rows)


ROW_MEAN_CASES = {
    "cosine_similarity": (lambda m: losses.CosineSimilarityLoss(m), ("anchor", "positive"), "score"),
    "contrastive": (lambda m: losses.ContrastiveLoss(m), ("anchor", "positive"), "binary"),
    "triplet": (lambda m: losses.TripletLoss(m), ("anchor", "positive", "negative"), None),
    "margin_mse": (lambda m: losses.MarginMSELoss(m), ("anchor", "positive", "negative"), "score"),
    "distill_kl_div": (lambda m: losses.DistillKLDivLoss(m), ("anchor", "positive", "negative"), "two"),
}


@pytest.mark.parametrize("case", list(ROW_MEAN_CASES))
def test_row_mean_embedding_losses_take_plain_accumulation_and_are_exact(tmp_path, case):
    """Losses that are a mean over independent rows need no gradient caching: routed `item_mean` (no extra forward),
    one step at GA = K equals the stock trainer's one batch of b x K."""
    make_loss, columns, label = ROW_MEAN_CASES[case]
    data = _columns(B * K, columns, label)
    large, _ = one_step(SentenceTransformerTrainer, tmp_path / "large", make_loss, B * K, 1, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path / "ours", make_loss, B, K, data)
    err = relative_difference(ours, large)
    print(f"{case}: route {trainer._st_route}, relative difference from the large batch {err:.2e}")
    assert trainer._st_route == "item_mean" and trainer.coupled_mode is None
    assert err <= TOL


def test_row_mean_loss_with_settings_not_recognised_keeps_the_coupled_route(tmp_path):
    """A summed (not averaged) CosineSimilarityLoss is not a row mean: it keeps the coupled route, and is exact."""
    data = _columns(B * K, ("anchor", "positive"), "score")

    def make_loss(model):
        return losses.CosineSimilarityLoss(model, loss_fct=torch.nn.MSELoss(reduction="sum"))

    large, _ = one_step(SentenceTransformerTrainer, tmp_path / "large", make_loss, B * K, 1, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path / "ours", make_loss, B, K, data)
    assert trainer._st_route == "coupled"
    assert relative_difference(ours, large) <= TOL
    assert sentence_transformers_route(losses.ContrastiveLoss(None, size_average=False))[0] == "coupled"


class RecordingRankingLoss(losses.MultipleNegativesRankingLoss):
    """A subclass that overrides `forward` (as sentence-transformers' own trainer tests do): records the feature keys
    it is handed, then runs the parent's forward."""

    def __init__(self, model):
        super().__init__(model)
        self.seen: set[str] = set()

    def forward(self, features, labels=None):
        self.seen.update(features[0].keys())
        return super().forward(features, labels)


class WeightedCoSENT(losses.CoSENTLoss):
    """A subclass whose own forward embeds the columns itself and adds a term of its own (a batch mean)."""

    def forward(self, features, labels):
        embeddings = [self.model(f)["sentence_embedding"] for f in features]
        return 2.0 * self.compute_loss_from_embeddings(embeddings, labels) + embeddings[0].mean(0).pow(2).sum()


class TokenReadingLoss(losses.MultipleNegativesRankingLoss):
    """A subclass whose forward reads a model output the replay does not have (token embeddings)."""

    def forward(self, features, labels=None):
        tokens = self.model(features[0])["token_embeddings"]
        return super().forward(features, labels) + tokens.mean(dim=(0, 1)).pow(2).sum()


class SelfTokenisingLoss(losses.MultipleNegativesRankingLoss):
    """A subclass whose forward embeds inputs of its own (texts it tokenises) besides the columns."""

    def forward(self, features, labels=None):
        extra = self.model.preprocess(["an extra sentence"])
        return super().forward(features, labels) + self.model(extra)["sentence_embedding"].pow(2).mean()


SUBCLASSES = {"recording": RecordingRankingLoss, "weighted_cosent": WeightedCoSENT}


@pytest.mark.parametrize("name", sorted(SUBCLASSES))
def test_subclass_overriding_forward_is_replayed_and_exact(tmp_path, name):
    """Its own forward runs on the window's embeddings: at GA = K it equals the stock trainer on one batch of b x K,
    while the stock trainer at GA = K is far from it."""
    make, data = SUBCLASSES[name], pairs(B * K, labels=name == "weighted_cosent")
    assert sentence_transformers_route(make(tiny_sentence_transformer(tmp_path)))[0] == "coupled"
    large, _ = one_step(SentenceTransformerTrainer, tmp_path, make, B * K, 1, data)
    stock, _ = one_step(SentenceTransformerTrainer, tmp_path, make, B, K, data)
    ours, trainer = one_step(GradAccumFirst, tmp_path, make, B, K, data)
    assert trainer._st_route == "coupled" and "replayed" in trainer._st_reason
    assert relative_difference(ours, large) <= TOL
    assert relative_difference(stock, large) >= 1e-2
    if name == "recording":
        # The forward is handed the collated features (with the column's index for the stand-in).
        assert {"input_ids", "attention_mask"} <= trainer.loss.seen


@pytest.mark.parametrize("make", [TokenReadingLoss, SelfTokenisingLoss], ids=["token_output", "own_inputs"])
def test_forward_the_replay_cannot_serve_falls_back_to_the_check(tmp_path, make):
    """A forward that needs more than the columns' sentence embeddings is found out on the first window: the
    split-invariance check decides instead, and stops before the first step (these two couple the batch)."""
    model = tiny_sentence_transformer(tmp_path)
    before = flat(model)
    from tests.st_cases import st_args

    trainer = GradAccumFirst(model=model, args=st_args(tmp_path, B, K), train_dataset=pairs(B * K), loss=make(model))
    with pytest.raises(SentenceTransformersLossError) as error:
        trainer.train()
    message = str(error.value)
    assert make.__name__ in message and "could not be replayed" in message and "NOT exact" in message
    assert trainer._st_route == "checked"
    assert torch.equal(flat(model), before)
