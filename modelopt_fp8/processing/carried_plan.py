"""The plan of every tensor outside the linear layers: norms, KV scales, embeddings, LM head.

Carried tensors are whatever the linear layers left unclaimed, so this runs after them; an FP8
tensor left over belongs to no quantized layer and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelopt_fp8.checkpoint.architecture import kv_scale_names
from modelopt_fp8.checkpoint.safetensors_files import TensorInfo
from modelopt_fp8.processing.checked_reads import CheckedReads
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.tensor_spec import FLOAT_DTYPES, TensorSpec
from protocol.errors import MissingTensorError, TensorDtypeError, UnsupportedQuantAlgoError
from protocol.schemas.layout import CarriedKind, CarriedLayout

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # vLLM never loads these
# vLLM pads the vocabulary of embeddings and LM heads to this multiple before splitting it over
# the TP ranks (``DEFAULT_VOCAB_PADDING_SIZE`` and ``pad_vocab_size`` in vLLM's
# ``vocab_parallel_embedding``; no LoRA, so no added vocabulary).
VOCAB_PADDING_SIZE = 64
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class CarriedPlan:
    """A tensor outside the linear layers, held as vLLM holds it after loading: norms and KV
    scales as stored, embeddings and the LM head as this rank's padded vocabulary rows."""

    spec: TensorSpec
    layout: CarriedLayout

    @property
    def source(self) -> str:
        return self.layout.source

    @property
    def rows(self) -> tuple[int, int] | None:
        """The checkpoint rows this rank holds (vocabulary-parallel tensors only); the storage
        rows after them are zero padding."""
        if self.layout.kind is not CarriedKind.vocab_parallel:
            return None
        assert self.layout.vocab_start is not None and self.layout.vocab_end is not None
        return self.layout.vocab_start, self.layout.vocab_end


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(rows per rank, first row, one past the last real row) of ``VocabParallelEmbedding``'s
    shard for this rank: the padded vocabulary split evenly, padding rows past ``vocab_size``
    (``VocabParallelEmbedding._get_indices``)."""
    padded = -(-vocab_size // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE
    per_rank = padded // tp_size
    start = min(tp_rank * per_rank, vocab_size)
    return per_rank, start, min(tp_rank * per_rank + per_rank, vocab_size)


def plan_kv_scales(reads: CheckedReads) -> list[CarriedPlan]:
    """The KV-cache scales under vLLM's names, from whichever spelling the checkpoint uses;
    each one required when ``kv_cache_quant_algo`` is set."""
    ckpt = reads.ckpt
    carried = []
    for vllm_name, candidates in kv_scale_names(ckpt.dims).items():
        source = next((c for c in candidates if c in ckpt.tensors), None)
        if source is None:
            if ckpt.quant.kv_cache_quant_algo:
                raise MissingTensorError(
                    "kv_cache_quant_algo is set but this KV scale is missing",
                    tensor=candidates[0],
                    file=str(ckpt.path),
                )
            continue
        reads.scale(source, (), (1,))
        spec = TensorSpec.contiguous(vllm_name, torch.float32, ckpt.tensors[source].shape)
        layout = CarriedLayout(name=vllm_name, kind=CarriedKind.checkpoint, source=source)
        carried.append(CarriedPlan(spec, layout))
    return carried


def plan_carried(reads: CheckedReads, tp_size: int, tp_rank: int) -> list[CarriedPlan]:
    """Every tensor no linear layer consumed (the embeddings and LM head always), checked to be
    an unquantized float tensor; the vocabulary-parallel ones split for rank ``tp_rank``."""
    ckpt = reads.ckpt
    dims = ckpt.dims
    expected = {"model.embed_tokens.weight": (dims.vocab_size, dims.hidden_size)}
    if not dims.tie_word_embeddings or "lm_head.weight" in ckpt.tensors:
        expected["lm_head.weight"] = (dims.vocab_size, dims.hidden_size)
    for name, shape in expected.items():
        info = reads.info(name)
        if info.dtype == FP8_DTYPE:
            raise UnsupportedQuantAlgoError(
                "a quantized embedding or lm_head is not supported; exclude it from quantization",
                file=str(info.file),
                tensor=name,
            )
        reads.expect_dtype(info, FLOAT_DTYPES)
        reads.expect_shape(info, shape)
    out = []
    for name, info in ckpt.tensors.items():
        if name in reads.consumed and name not in expected:
            continue
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        if info.dtype == FP8_DTYPE:
            raise TensorDtypeError(
                "fp8 tensor that belongs to no quantized layer of this architecture",
                file=str(info.file),
                tensor=name,
            )
        if info.dtype not in FLOAT_DTYPES:
            raise TensorDtypeError(
                f"dtype is {info.dtype}; a tensor carried as stored must be "
                f"{' or '.join(str(d) for d in FLOAT_DTYPES)}",
                file=str(info.file),
                tensor=name,
            )
        out.append(_carry(name, info, ckpt.dims.vocab_size, tp_size, tp_rank))
    return out


def _carry(name: str, info: TensorInfo, vocab: int, tp_size: int, tp_rank: int) -> CarriedPlan:
    if name not in VOCAB_PARALLEL:
        spec = TensorSpec.contiguous(name, info.dtype, info.shape)
        return CarriedPlan(spec, CarriedLayout(name=name, kind=CarriedKind.replicated, source=name))
    per_rank, start, end = vocab_shard(vocab, tp_size, tp_rank)
    spec = TensorSpec.contiguous(name, info.dtype, (per_rank, info.shape[1]))
    layout = CarriedLayout(
        name=name,
        kind=CarriedKind.vocab_parallel,
        source=name,
        vocab_size=vocab,
        padding_size=VOCAB_PADDING_SIZE,
        vocab_start=start,
        vocab_end=end,
    )
    return CarriedPlan(spec, layout)
