"""The loss and trainer classes sentence-transformers ships, named by how they accumulate. By name, so that nothing is
imported before sentence-transformers is; read by the routing and by the composition registry."""

# Loss classes (by name, so that nothing is imported before sentence-transformers is) whose `forward` is exactly
# "embed every column with `self.model`, then `compute_loss_from_embeddings(embeddings, labels)`". A subclass that
# keeps one of these `forward`s is routed too; one that overrides `forward` is not (its forward may do more).
EMBEDDING_LOSSES = (
    "MultipleNegativesRankingLoss",
    "CoSENTLoss",
    "AnglELoss",
    "CosineSimilarityLoss",
    "ContrastiveLoss",
    "OnlineContrastiveLoss",
    "TripletLoss",
    "MarginMSELoss",
    "DistillKLDivLoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchHardSoftMarginTripletLoss",
    "BatchSemiHardTripletLoss",
)
# Embedding losses that are a mean over independent rows when built with the settings `row_mean_settings` accepts:
# plain accumulation weighted by rows is exact for them, without the coupled mode's extra forward per micro-batch.
ROW_MEAN_EMBEDDING_LOSSES = (
    "CosineSimilarityLoss",
    "ContrastiveLoss",
    "TripletLoss",
    "MarginMSELoss",
    "DistillKLDivLoss",
)
# `forward` runs the guide model too: replayed on the window's embeddings by `_gist_coupled_loss`.
GUIDED_LOSSES = ("GISTEmbedLoss",)
# `forward` embeds the columns with `self.model` (sentence-transformers' `embed_columns`) and computes everything
# else from those embeddings (SpladeLoss: its ranking loss plus the FLOPS regularisers, batch means of the
# embeddings): replayed on the window's embeddings by `_replayed_coupled_loss`.
REPLAYED_LOSSES = ("SpladeLoss",)
# MultiVectorEncoder losses whose `forward` embeds the columns token by token with `self.model` and computes
# everything else from those token embeddings and their scoring masks: replayed by `_multi_vector_coupled_loss`.
MULTI_VECTOR_LOSSES = ("MultiVectorMultipleNegativesRankingLoss",)
# Gradient caching within one micro-batch: under accumulation their negatives are the micro-batch's only, unless
# routed by `CACHED_COUPLED_LOSSES`.
CACHED_LOSSES = {
    "CachedMultipleNegativesRankingLoss": "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss": "MultipleNegativesSymmetricRankingLoss",
    "CachedGISTEmbedLoss": "GISTEmbedLoss",
    "CachedSpladeLoss": "SpladeLoss",
    "CachedMultiVectorMultipleNegativesRankingLoss": "MultiVectorMultipleNegativesRankingLoss",
}
# Cached losses whose `calculate_loss(embeddings...)` is the whole loss computed from the column embeddings: the
# coupled mode (itself gradient caching, over the window) feeds it the window's embeddings, which is the cached loss
# on the large batch (its `mini_batch_size` chunks only bound memory). `CachedGISTEmbedLoss` also runs its guide model
# inside, and CrossEncoder's cached loss scores (query, document) pairs inside: both stay refused.
CACHED_COUPLED_LOSSES = (
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "CachedSpladeLoss",
    "CachedMultiVectorMultipleNegativesRankingLoss",
)
# The trainer of each cached loss that is not a SentenceTransformer loss.
CACHED_LOSS_TRAINERS = {
    "CachedSpladeLoss": "SparseEncoderTrainer",
    "CachedMultiVectorMultipleNegativesRankingLoss": "MultiVectorEncoderTrainer",
}
# CrossEncoder's cached in-batch-negatives loss: its non-cached MultipleNegativesRankingLoss is no way out, since it
# pairs each query with the other rows' documents inside the loss, which no route replays over the window (the
# first-window check refuses it too).
CROSS_ENCODER_CACHED_FIX = (
    "Keep the cached loss with gradient_accumulation_steps=1 and the large batch as per_device_train_batch_size "
    "(its mini_batch_size already bounds the memory). Its non-cached MultipleNegativesRankingLoss is no alternative: "
    "CrossEncoderTrainer's in-batch negatives are scored as (query, other row's document) pairs inside the loss, "
    "which GradAccumTrainer does not replay over the window, so it is refused as well. BinaryCrossEntropyLoss on "
    "labelled pairs (e.g. mined hard negatives) accumulates exactly; ListNetLoss over (query, [documents]) rows is "
    "checked on the first window and trains when the check finds it exact."
)
# CrossEncoder losses that are a mean over independent rows (pairs): plain accumulation weighted by rows.
CROSS_ENCODER_ROW_LOSSES = ("BinaryCrossEntropyLoss", "CrossEntropyLoss", "MSELoss", "MarginMSELoss")
# sentence-transformers' trainers (6.x: all subclasses of its `BaseTrainer`; 5.x has the first three).
SENTENCE_TRANSFORMERS_TRAINERS = (
    "SentenceTransformerTrainer",
    "CrossEncoderTrainer",
    "SparseEncoderTrainer",
    "MultiVectorEncoderTrainer",
)
