"""Which slice of each checkpoint tensor a tensor-parallel rank holds, as vLLM's
column-, QKV- and row-parallel weight loaders cut them.

* ``QKVParallelLinear``: query heads split evenly. Key/value heads split evenly while there are at
  least as many as ranks; past that each kv head is replicated on ``tp_size // num_kv_heads``
  consecutive ranks, and rank ``r`` holds kv head ``r // replicas``.
* ``MergedColumnParallelLinear``: each fused shard's output rows split evenly.
* ``RowParallelLinear``: the input columns split evenly; output rows (and per-channel scales,
  biases) are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelopt_fp8.checkpoint.architecture import LinearSpec, ModelDims, Parallelism, ShardSpec
from protocol.errors import TensorParallelError

Range = tuple[int, int]


@dataclass(frozen=True)
class ShardSlice:
    """The half-open row and column ranges of one shard's weight on one rank."""

    rows: Range
    cols: Range

    @property
    def width(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def input_size(self) -> int:
        return self.cols[1] - self.cols[0]


def check_tp_size(dims: ModelDims, tp_size: int) -> None:
    """Refuse a TP size vLLM could not split this model into."""
    problems = []
    if tp_size < 1:
        problems.append("tp_size must be at least 1")
    elif dims.num_attention_heads % tp_size:
        problems.append(f"{dims.num_attention_heads} attention heads")
    elif tp_size >= dims.num_key_value_heads:
        if tp_size % dims.num_key_value_heads:
            problems.append(f"{dims.num_key_value_heads} kv heads (replication needs a multiple)")
    elif dims.num_key_value_heads % tp_size:
        problems.append(f"{dims.num_key_value_heads} kv heads")
    if tp_size >= 1 and dims.intermediate_size % tp_size:
        problems.append(f"intermediate_size {dims.intermediate_size}")
    padded_vocab = -(-dims.vocab_size // 64) * 64  # vLLM's vocabulary padding
    if tp_size >= 1 and padded_vocab % tp_size:
        problems.append(f"padded vocabulary {padded_vocab}")
    if problems:
        raise TensorParallelError(
            f"tp_size {tp_size} does not divide: {', '.join(problems)}", tp_size=tp_size
        )


def _even(total: int, tp_size: int, rank: int) -> Range:
    part = total // tp_size
    return rank * part, (rank + 1) * part


def shard_slice(
    spec: LinearSpec, shard: ShardSpec, dims: ModelDims, tp_size: int, rank: int
) -> ShardSlice:
    """Rows and columns of ``shard``'s ``[out, in]`` weight that ``rank`` holds."""
    full_cols = (0, spec.input_size)
    if spec.parallelism is Parallelism.ROW:
        return ShardSlice(rows=(0, shard.rows), cols=_even(spec.input_size, tp_size, rank))
    if spec.parallelism is Parallelism.QKV and shard.shard_id in ("k", "v"):
        kv_heads, head_dim = dims.num_key_value_heads, dims.head_dim
        if tp_size >= kv_heads:
            head = rank // (tp_size // kv_heads)
            return ShardSlice(rows=(head * head_dim, (head + 1) * head_dim), cols=full_cols)
        return ShardSlice(rows=_even(shard.rows, tp_size, rank), cols=full_cols)
    return ShardSlice(rows=_even(shard.rows, tp_size, rank), cols=full_cols)
