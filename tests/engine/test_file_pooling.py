"""What the daemon takes a [[models]] GGUF for, from its header (engine/embedders.file_pooling): a pooling type's
embedding model or reranker, a cross-encoder's one-output classifier (a reranker, as llama-server's --reranking
serves it), a classifier of several outputs (refused by name), or a model that generates text."""

from __future__ import annotations

from pathlib import Path

import pytest

from syshaxd.engine.embedders import embedding_file, file_pooling
from syshaxd.engine.entry_models import ModelsError

PATH = Path("/m/file.gguf")
BERT_TENSORS = [("token_embd.weight", (256, 4000), 1), ("blk.0.attn_q.weight", (256, 256), 1)]


def _meta(**extra) -> dict:
    return {"general.architecture": "bert", "bert.embedding_length": 256, "bert.context_length": 512, **extra}


@pytest.mark.parametrize("meta, tensors, pooling", [
    (_meta(**{"bert.pooling_type": 1}), BERT_TENSORS, 1),  # mean: an embedding model
    (_meta(**{"bert.pooling_type": 4, "bert.classifier.output_labels": ["yes", "no"]}), BERT_TENSORS, 4),  # Qwen3's
    (_meta(**{"bert.classifier.output_labels": ["LABEL_0"]}), BERT_TENSORS, 4),  # bge-reranker, converted today
    (_meta(), BERT_TENSORS + [("cls.output.weight", (256, 1), 0)], 4),  # converted before the labels were written
    (_meta(), BERT_TENSORS, 0),  # neither: a model that generates text
])
def test_what_the_header_says_the_file_is(meta, tensors, pooling):
    assert file_pooling(meta, tensors, PATH, "models[0] (m)") == pooling
    if pooling:
        assert embedding_file(meta, tensors, PATH, "models[0] (m)").reranker == (pooling == 4)


def test_a_classifier_of_several_outputs_is_refused_by_name():
    meta = _meta(**{"bert.classifier.output_labels": ["negative", "neutral", "positive"]})
    with pytest.raises(ModelsError) as caught:
        file_pooling(meta, BERT_TENSORS, PATH, "models[0] (m)")
    assert str(caught.value) == ("models[0] (m): file.gguf is a classifier of 3 outputs (negative, neutral, "
                                 "positive), not a reranker (one output) or an embedding model (a pooling type); it "
                                 "is not served")
